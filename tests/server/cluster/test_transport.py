"""KV transfers over loopback TCP and shared memory, in process and across processes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from server.cluster.codec import Codec, Frame, KVChunk, decode, encode
from server.cluster.shm import shm_dir
from server.cluster.transport import (
    KVReceiver,
    ProtocolError,
    TransferClosed,
    TransferRejected,
    TransferTimeout,
    Unauthenticated,
    open_sender,
)
from server.cluster.wire import DATA, REPLY, Seal, control, read_frame, write_frame

torch.set_num_threads(1)

BLOCK = 4
MODES = ["tcp", "shm"]
KEY = b"transport-test-key-0123456789ab"  # the cluster's KV key in these tests
ROOT = Path(__file__).resolve().parents[3]


def chunk(
    first_block: int, blocks: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32
) -> KVChunk:
    g = torch.Generator().manual_seed(seed * 1000 + first_block)
    shape = (2, 2, blocks * BLOCK, 8)
    return KVChunk(
        first_block,
        torch.randn(shape, generator=g).to(dtype),
        torch.randn(shape, generator=g).to(dtype),
    )


def frames(codec: Codec, n: int = 3, seed: int = 0) -> list[Frame]:
    return [encode(chunk(2 * i, seed=seed), codec, block_size=BLOCK) for i in range(n)]


def bound(direction: bytes, transfer_id: str) -> Seal:
    seal = Seal(KEY, direction)
    seal.bind(transfer_id)
    return seal


def leftovers() -> list[Path]:
    return sorted(shm_dir().glob(f"askv-{os.getpid()}-*"))


class Recorder:
    """Records what the receiver calls; can refuse, fail frames (by decoding them) or stall."""

    def __init__(self, *, refuse: str | None = None, fail_end: bool = False) -> None:
        self.refuse, self.fail_end = refuse, fail_end
        self.opened: dict[str, dict[str, Any]] = {}
        self.frames: dict[str, list[Frame]] = {}
        self.ends: list[tuple[str, str | None]] = []
        self.ended = asyncio.Event()
        self.stall: asyncio.Event | None = None

    async def on_open(self, transfer_id: str, header: dict[str, Any]) -> None:
        if self.refuse:
            raise LookupError(self.refuse)
        self.opened[transfer_id] = header
        self.frames[transfer_id] = []

    async def on_frame(self, transfer_id: str, frame: Frame) -> None:
        self.frames[transfer_id].append(frame)
        if self.stall is not None:
            await self.stall.wait()
        decode(frame, dtype=torch.float32)  # a corrupt payload raises here

    async def on_end(self, transfer_id: str, error: str | None) -> None:
        self.ends.append((transfer_id, error))
        self.ended.set()
        if self.fail_end and error is None:
            raise RuntimeError("pool full")


def run(
    body: Callable[[KVReceiver, Recorder], Awaitable[Any]],
    handler: Recorder | None = None,
    **kw: Any,
) -> Any:
    async def main() -> Any:
        receiver = KVReceiver(handler or Recorder(), key=KEY, **kw)
        await receiver.start()
        try:
            return await asyncio.wait_for(body(receiver, receiver.handler), 20)  # type: ignore[arg-type]
        finally:
            await receiver.close()

    return asyncio.run(main())


async def ended(handler: Recorder, n: int = 1) -> None:
    while len(handler.ends) < n:
        handler.ended.clear()
        await asyncio.wait_for(handler.ended.wait(), 5)


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.FP32])
@pytest.mark.parametrize("mode", MODES)
def test_frames_arrive_in_order_and_stats_agree(mode: str, codec: Codec) -> None:
    sent = frames(codec)

    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        sender = await open_sender(receiver.address(mode), "t1", codec=codec, key=KEY, meta={"model": "m"})
        for frame in sent:
            await sender.send(frame)
        await sender.finish()
        assert (
            handler.opened["t1"]["meta"] == {"model": "m"} and handler.opened["t1"]["mode"] == mode
        )
        got = handler.frames["t1"]
        assert [f.header for f in got] == [f.header for f in sent]  # shm fields stripped
        assert [bytes(f.payload) for f in got] == [bytes(f.payload) for f in sent]
        assert handler.ends == [("t1", None)]
        link = receiver.stats[f"{mode}://127.0.0.1"]
        mine = sender.stats
        assert (link.bytes, link.frames, link.transfers, link.failures) == (mine.bytes, 5, 1, 0)
        assert (mine.frames, mine.transfers, mine.failures) == (5, 1, 0)
        assert mine.bytes > sum(len(f.payload) for f in sent) and mine.throughput > 0
        assert link.seconds > 0

    run(body)
    assert leftovers() == []


@pytest.mark.parametrize("mode", MODES)
def test_sender_gone_without_end_fails_the_transfer(mode: str) -> None:
    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        sender = await open_sender(receiver.address(mode), "t1", codec=Codec.BF16, key=KEY)
        await sender.send(frames(Codec.BF16, 1)[0])
        sender._writer.transport.abort()  # type: ignore[attr-defined]  # the process died
        await ended(handler)
        # EOF or a reset, depending on whether the receiver had written an ack (shm) first
        assert handler.ends[0][0] == "t1" and (handler.ends[0][1] or "").startswith("TransferClosed")
        assert len(handler.frames["t1"]) <= 1
        assert receiver.stats[f"{mode}://127.0.0.1"].failures == 1

    run(body)


@pytest.mark.parametrize("mode", MODES)
def test_corrupt_payload_rejects_the_transfer_and_the_receiver_keeps_serving(mode: str) -> None:
    bad = frames(Codec.INT8, 4)
    bad[1].payload[3] ^= 0xFF  # type: ignore[index]

    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        sender = await open_sender(receiver.address(mode), "bad", codec=Codec.INT8, key=KEY)
        with pytest.raises(TransferRejected, match="CorruptPayload: KV payload checksum mismatch"):
            for frame in bad:
                await sender.send(frame)
            await sender.finish()
        await ended(handler)
        assert handler.ends == [("bad", handler.ends[0][1])] and "checksum" in handler.ends[0][1]
        assert sender.stats.failures == 1 and sender.stats.transfers == 0
        good = await open_sender(receiver.address(mode), "good", codec=Codec.INT8, key=KEY)
        for frame in frames(Codec.INT8, 2):
            await good.send(frame)
        await good.finish()
        assert handler.ends[-1] == ("good", None) and len(handler.frames["good"]) == 2
        link = receiver.stats[f"{mode}://127.0.0.1"]
        assert (link.transfers, link.failures) == (1, 1)

    run(body)
    assert leftovers() == []


def test_rejected_open_raises_and_never_ends() -> None:
    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        with pytest.raises(TransferRejected, match="LookupError: unknown request r9"):
            await open_sender(receiver.address("shm"), "r9", codec=Codec.BF16, key=KEY)
        assert handler.ends == []

    run(body, Recorder(refuse="unknown request r9"))


def test_failing_on_end_rejects_finish() -> None:
    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        sender = await open_sender(receiver.address("tcp"), "t1", codec=Codec.BF16, key=KEY)
        await sender.send(frames(Codec.BF16, 1)[0])
        with pytest.raises(TransferRejected, match="RuntimeError: pool full"):
            await sender.finish()
        assert handler.ends == [("t1", None)]  # once, never again with the error
        assert receiver.stats["tcp://127.0.0.1"].failures == 1

    run(body, Recorder(fail_end=True))


@pytest.mark.parametrize("mode", MODES)
def test_abort_reaches_on_end_and_leaves_no_shared_memory(mode: str) -> None:
    handler = Recorder()
    handler.stall = asyncio.Event()  # the receiver holds the first frame: the rest wait in shm

    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        sender = await open_sender(receiver.address(mode), "t1", codec=Codec.FP32, key=KEY)
        for frame in frames(Codec.FP32, 3):
            await sender.send(frame)
        if mode == "shm":
            await asyncio.sleep(0.05)
            assert len(leftovers()) == 2  # the receiver copied the first one out
        await sender.abort("client cancelled")
        assert leftovers() == []
        await sender.abort("twice is harmless")
        handler.stall.set()  # type: ignore[union-attr]
        await ended(handler)
        assert handler.ends == [("t1", "the sender aborted the transfer: client cancelled")]

    run(body, handler)


@pytest.mark.parametrize("mode", MODES)
def test_a_stalled_receiver_applies_back_pressure(mode: str) -> None:
    handler = Recorder()
    handler.stall = asyncio.Event()
    big = bytearray(4 << 20)
    frame = Frame({"kind": "kv", "codec": "bf16"}, big)  # never decoded: the handler stalls

    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        sender = await open_sender(receiver.address(mode), "t1", codec=Codec.BF16, key=KEY, timeout=0.3)
        with pytest.raises(TransferTimeout, match=r"within 0\.3s|for 0\.3s"):
            for _ in range(30):
                await sender.send(frame)
        assert sender.stats.frames < 30
        await sender.abort("stalled")
        handler.stall.set()  # type: ignore[union-attr]
        await ended(handler)
        assert handler.ends[0][1] is not None

    run(body, handler)
    assert leftovers() == []


def test_connection_refused_names_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there

    with pytest.raises(TransferClosed, match=f"tcp://127.0.0.1:{port}"):
        asyncio.run(open_sender(f"tcp://127.0.0.1:{port}", "t", codec=Codec.BF16, key=KEY))
    with pytest.raises(ValueError, match="tcp://host:port"):
        asyncio.run(open_sender(f"http://127.0.0.1:{port}", "t", codec=Codec.BF16, key=KEY))


def test_idle_sender_times_out_on_the_receiver() -> None:
    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        sender = await open_sender(receiver.address("tcp"), "t1", codec=Codec.BF16, key=KEY)
        await ended(handler)
        assert "no complete frame" in (handler.ends[0][1] or "")
        with pytest.raises(TransferRejected, match="TransferTimeout"):
            await sender.finish()

    run(body, idle_timeout=0.2)


def test_receiver_survives_garbage_and_early_closes() -> None:
    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        port = receiver.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = await read_frame(reader, Seal(KEY, REPLY))
        assert reply.header["kind"] == "error" and "bad magic" in reply.header["message"]
        writer.close()
        _, writer = await asyncio.open_connection("127.0.0.1", port)  # connect, say nothing, leave
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # kv before open
        await write_frame(writer, control("end"), Seal(KEY, DATA))
        assert "starts with an 'open'" in (await read_frame(reader, Seal(KEY, REPLY))).header["message"]
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # another host's shm
        elsewhere = control(
            "open", transfer_id="x", codec="bf16", mode="shm", shm_probe="askv-1-beef-probe"
        )
        await write_frame(writer, elsewhere, Seal(KEY, DATA))
        assert "needs the sender on this host" in (await read_frame(reader, bound(REPLY, "x"))).header["message"]
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # shm name escaping
        probe = f"askv-{os.getpid()}-abc-probe"
        (shm_dir() / probe).touch()
        opening = control("open", transfer_id="x", codec="bf16", mode="shm", shm_probe=probe)
        out, back = Seal(KEY, DATA), bound(REPLY, "x")
        await write_frame(writer, opening, out)
        out.bind("x")
        assert (await read_frame(reader, back)).header["kind"] == "ack"
        shm = {"name": "../../etc/passwd", "length": 10, "mac": ""}
        await write_frame(writer, control("kv", codec="bf16", seq=0, shm=shm), out)
        assert "invalid shared-memory payload name" in (await read_frame(reader, back)).header["message"]
        writer.close()
        sender = await open_sender(receiver.address("tcp"), "after", codec=Codec.BF16, key=KEY)
        await sender.send(frames(Codec.BF16, 1)[0])
        await sender.finish()
        assert handler.ends[-1] == ("after", None)
        assert handler.ends[0][0] == "x" and "ProtocolError" in (handler.ends[0][1] or "")

    run(body)


def test_closing_the_receiver_fails_transfers_in_progress() -> None:
    async def main() -> Recorder:
        handler = Recorder()
        receiver = KVReceiver(handler, key=KEY)
        await receiver.start()
        sender = await open_sender(receiver.address("tcp"), "t1", codec=Codec.BF16, key=KEY)
        await sender.send(frames(Codec.BF16, 1)[0])
        await asyncio.sleep(0.05)
        await receiver.close()
        with pytest.raises((TransferClosed, TransferRejected)):
            await sender.finish()
        return handler

    handler = asyncio.run(main())
    assert handler.ends == [("t1", "the receiver closed")]


def test_kv_frame_of_another_codec_is_refused_on_both_ends() -> None:
    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        sender = await open_sender(receiver.address("tcp"), "t1", codec=Codec.BF16, key=KEY)
        with pytest.raises(ValueError, match="codec bf16"):
            await sender.send(frames(Codec.INT8, 1)[0])
        await sender.abort("bug")
        reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
        out, back = Seal(KEY, DATA), bound(REPLY, "t2")
        await write_frame(writer, control("open", transfer_id="t2", codec="bf16", mode="tcp"), out)
        out.bind("t2")
        assert (await read_frame(reader, back)).header["kind"] == "ack"
        await write_frame(writer, frames(Codec.INT8, 1)[0], out)
        reply = (await read_frame(reader, back)).header
        assert reply["kind"] == "error" and "'int8' in a bf16 transfer" in reply["message"]
        writer.close()
        await ended(handler, 2)
        assert handler.ends[1][0] == "t2" and ProtocolError.__name__ in (handler.ends[1][1] or "")

    run(body)


# -- across processes ---------------------------------------------------------------------------

RECEIVER = """
import asyncio, hashlib, json, sys
import torch
torch.set_num_threads(1)
from server.cluster.codec import decode
from server.cluster.transport import KVReceiver

class Digests:
    def __init__(self, expect):
        self.expect, self.hashes, self.done = expect, {}, asyncio.Event()
    async def on_open(self, transfer_id, header):
        self.hashes[transfer_id] = hashlib.sha256()
    async def on_frame(self, transfer_id, frame):
        kv = decode(frame, dtype=torch.bfloat16)
        h = self.hashes[transfer_id]
        h.update(str(kv.first_block).encode())
        h.update(kv.k.view(torch.uint8).numpy().tobytes())
        h.update(kv.v.view(torch.uint8).numpy().tobytes())
    async def on_end(self, transfer_id, error):
        digest = self.hashes.pop(transfer_id).hexdigest()
        line = {"transfer_id": transfer_id, "error": error, "digest": digest}
        print(json.dumps(line), flush=True)
        self.expect -= 1
        if not self.expect:
            self.done.set()

async def main():
    handler = Digests(int(sys.argv[1]))
    receiver = KVReceiver(handler, key=sys.argv[2].encode())
    await receiver.start()
    print(json.dumps({"port": receiver.port}), flush=True)
    await handler.done.wait()
    stats = {k: [s.bytes, s.frames] for k, s in receiver.stats.items()}
    print(json.dumps({"stats": stats}), flush=True)
    await receiver.close()

asyncio.run(main())
"""


def digest(sent: list[KVChunk], codec: Codec) -> str:
    h = hashlib.sha256()
    for c in sent:
        kv = decode(encode(c, codec, block_size=BLOCK), dtype=torch.bfloat16)
        h.update(str(kv.first_block).encode())
        h.update(kv.k.view(torch.uint8).numpy().tobytes())
        h.update(kv.v.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_transfer_to_another_process_over_tcp_and_shm() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, "2", KEY.decode()], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        plan = {"tcp": Codec.BF16, "shm": Codec.INT8}
        chunks = [chunk(4 * i, blocks=4, seed=7, dtype=torch.bfloat16) for i in range(3)]
        sent_bytes: dict[str, list[int]] = {}

        async def send_all() -> None:
            for mode, codec in plan.items():
                sender = await open_sender(f"{mode}://127.0.0.1:{port}", mode, codec=codec, key=KEY)
                for c in chunks:
                    await sender.send(encode(c, codec, block_size=BLOCK))
                await sender.finish()
                sent_bytes[f"{mode}://127.0.0.1"] = [sender.stats.bytes, sender.stats.frames]

        asyncio.run(asyncio.wait_for(send_all(), 30))
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    lines = [json.loads(line) for line in out.splitlines()]
    ends = {line["transfer_id"]: line for line in lines if "transfer_id" in line}
    for mode, codec in plan.items():
        assert ends[mode]["error"] is None
        assert ends[mode]["digest"] == digest(chunks, codec), mode
    assert lines[-1]["stats"] == sent_bytes
    assert leftovers() == []


# -- authentication ------------------------------------------------------------------------------


class Tap:
    """A writer that keeps the bytes a sender writes (frames as the wire has them)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.data += data

    async def drain(self) -> None:
        pass


async def wire_bytes(frame_list: list[Frame], transfer_id: str, key: bytes = KEY) -> list[bytes]:
    """``open`` for ``transfer_id`` then ``frame_list``, each as its bytes on the wire."""
    seal, out = Seal(key, DATA), []
    for i, f in enumerate([control("open", transfer_id=transfer_id, codec="bf16", mode="tcp"), *frame_list]):
        tap = Tap()
        await write_frame(tap, f, seal)
        if i == 0:
            seal.bind(transfer_id)
        out.append(bytes(tap.data))
    return out


async def push(port: int, data: list[bytes]) -> None:
    """Write ``data`` blindly and wait for the receiver to hang up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for d in data:
            writer.write(d)
        await writer.drain()
        await asyncio.wait_for(reader.read(), 5)
    except (ConnectionError, TimeoutError):
        pass
    writer.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_sender_with_another_key_is_refused_before_its_transfer_opens(mode: str) -> None:
    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        with pytest.raises(Unauthenticated, match="do not hold the same cluster secret"):
            await open_sender(receiver.address(mode), "t1", codec=Codec.BF16, key=b"x" * 32)
        assert receiver.refused == 1
        assert handler.opened == {} and handler.ends == []  # nothing reached the handler
        sender = await open_sender(receiver.address(mode), "t2", codec=Codec.BF16, key=KEY)
        await sender.send(frames(Codec.BF16, 1)[0])
        await sender.finish()
        assert handler.ends == [("t2", None)] and receiver.refused == 1

    run(body)


def test_frames_without_a_tag_altered_or_replayed_into_another_transfer_are_refused() -> None:
    """An old (untagged) frame, a payload byte flipped on the wire, and a genuine frame of
    transfer A sent in transfer B: each is refused, counted, and never reaches ``on_frame``."""

    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        kv = frames(Codec.BF16, 1)[0]
        legacy = json.dumps(control("open", transfer_id="old", codec="bf16", mode="tcp").header).encode()
        await push(receiver.port, [struct.pack("<4sBIQ", b"ASKV", 1, len(legacy), 0) + legacy])
        altered = await wire_bytes([kv], "flip")
        payload_byte = len(altered[1]) - 32 - 10  # inside the payload, before the tag
        altered[1] = altered[1][:payload_byte] + bytes([altered[1][payload_byte] ^ 1]) + altered[1][payload_byte + 1:]
        await push(receiver.port, altered)
        a, b = await wire_bytes([kv], "A"), await wire_bytes([kv], "B")
        await push(receiver.port, [b[0], a[1]])
        await ended(handler, 2)  # "flip" and "B" were opened (their open frames were genuine)
        assert receiver.refused == 3
        assert handler.frames == {"flip": [], "B": []}
        assert all("Unauthenticated" in (error or "") for _, error in handler.ends)

    run(body)


def test_a_shared_memory_payload_swapped_after_the_sender_wrote_it_is_refused() -> None:
    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        probe = f"askv-{os.getpid()}-feed-probe"
        (shm_dir() / probe).touch()
        reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
        out, back = Seal(KEY, DATA), bound(REPLY, "s")
        await write_frame(writer, control("open", transfer_id="s", codec="bf16", mode="shm", shm_probe=probe), out)
        out.bind("s")
        assert (await read_frame(reader, back)).header["kind"] == "ack"
        kv = frames(Codec.BF16, 1)[0]
        name = f"askv-{os.getpid()}-feed-0"
        forged = bytes(len(kv.payload))  # what another local process put in its place
        (shm_dir() / name).write_bytes(forged)
        shm = {"name": name, "length": len(forged), "mac": out.payload_mac(kv.payload, 0)}
        await write_frame(writer, Frame({**kv.header, "seq": 0, "shm": shm}), out)
        reply = (await read_frame(reader, back)).header
        assert reply["kind"] == "error" and "failed authentication" in reply["message"]
        writer.close()
        await ended(handler)
        assert receiver.refused == 1 and handler.frames == {"s": []}
        assert leftovers() == []

    run(body)


@pytest.mark.parametrize("mode", MODES)
def test_an_ack_read_before_the_open_write_returns_is_still_authentic(mode: str, monkeypatch) -> None:
    """Under uvloop a socket write goes out at once, and the receiver's ack can be read while the
    sender is still returning from writing ``open``: the reply seal must be bound already. Here
    the return is delayed until the ack has surely been read."""
    from server.cluster import tcp

    real = tcp.write_frame

    async def slow_open(writer, frame, seal):
        n = await real(writer, frame, seal)
        if frame.header.get("kind") == "open":
            await asyncio.sleep(0.2)  # the reply reader runs meanwhile
        return n

    monkeypatch.setattr(tcp, "write_frame", slow_open)

    async def body(receiver: KVReceiver, handler: Recorder) -> None:
        sender = await open_sender(receiver.address(mode), "t-early", codec=Codec.BF16, key=KEY)
        await sender.send(frames(Codec.BF16, 1)[0])
        await sender.finish()
        await ended(handler)
        assert handler.ends == [("t-early", None)]

    run(body)
