"""Prefix KV from one host's store into another's over the cluster transport (real TCP, real
HMAC; no vLLM needed): what arrives, what is pinned, and what is refused."""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from server.cluster.codec import Frame
from server.cluster.errors import TransferError, TransferRejected, TransferTimeout
from server.cluster.transport import KVReceiver, open_sender
from server.vllm.relay import StoreReceiver, push_blocks, transfer_codec
from server.vllm.store import KVStore, StoreBlock, prefix_blocks

FAMILY = "f" * 64
KEY = b"k" * 32
TOKENS = list(range(40))


def _stores(tmp_path: Path, fmt_b: str = "fmt") -> tuple[KVStore, KVStore, list[StoreBlock]]:
    """Store A holding the KV of TOKENS (16-token blocks and a tail), and an empty store B."""
    a = KVStore(tmp_path / "a", fmt="fmt", capacity_bytes=1 << 20, role="a")
    b = KVStore(tmp_path / "b", fmt=fmt_b, capacity_bytes=1 << 20, role="b")
    blocks = prefix_blocks(TOKENS, family=FAMILY, salt="tenant", block_size=16)
    rng = np.random.default_rng(0)
    for blk in blocks:
        a.put(blk.key, parent=blk.parent, tokens=TOKENS[blk.start:blk.end],
              kv=rng.integers(0, 255, (3, 1, 2, 16, 8), dtype=np.uint8))
    return a, b, blocks


def _push(a: KVStore, blocks: list[StoreBlock], address: str, *, key: bytes = KEY, fmt: str = "fmt",
          pin: str = "req-1"):
    return push_blocks(a, blocks, TOKENS, address=address, key=key, fmt=fmt, codec="fp32", pin=pin, ttl=60,
                       transfer_id="t1", timeout=5)


def _run(b: KVStore, body, fmt: str = "fmt"):
    async def main():
        handler = StoreReceiver(b, fmt)
        receiver = KVReceiver(handler, key=KEY)
        await receiver.start()
        try:
            return await body(receiver.address("tcp")), handler, receiver
        finally:
            await receiver.close()

    return asyncio.run(main())


def test_pushed_blocks_arrive_whole_and_pinned(tmp_path: Path) -> None:
    a, b, blocks = _stores(tmp_path)
    pushed, handler, _ = _run(b, lambda addr: _push(a, blocks, addr))
    assert (pushed.blocks, handler.received_blocks) == (3, 3)
    for blk in blocks:
        got = b.get(blk.key, parent=blk.parent, tokens=TOKENS[blk.start:blk.end])
        want = a.get(blk.key, parent=blk.parent, tokens=TOKENS[blk.start:blk.end])
        assert got is not None and want is not None and np.array_equal(got, want)
    assert pushed.bytes == handler.received_bytes == sum(
        a.get(x.key, parent=x.parent, tokens=TOKENS[x.start:x.end]).nbytes for x in blocks)
    pin = json.loads((b.pins / "req-1").read_text())
    assert pin["keys"] == [blk.key.hex() for blk in blocks]  # nothing of the request's evicted before it ends


def test_a_push_can_pin_more_than_it_sends(tmp_path: Path) -> None:
    """The node already holds the first blocks: only the rest travel, every key is pinned."""
    a, b, blocks = _stores(tmp_path)
    pushed, handler, _ = _run(b, lambda addr: push_blocks(
        a, blocks[2:], TOKENS, address=addr, key=KEY, fmt="fmt", codec="fp32", pin="req-2", ttl=60,
        transfer_id="t2", keys=[x.key for x in blocks]))
    assert pushed.blocks == handler.received_blocks == 1
    assert json.loads((b.pins / "req-2").read_text())["keys"] == [x.key.hex() for x in blocks]
    assert not b.contains(blocks[0].key) and b.contains(blocks[2].key)


def test_a_sender_without_the_cluster_key_writes_nothing(tmp_path: Path) -> None:
    a, b, blocks = _stores(tmp_path)

    async def body(addr: str):
        with pytest.raises(TransferError):
            await _push(a, blocks, addr, key=b"x" * 32)

    _, handler, receiver = _run(b, body)
    assert receiver.refused == 1
    assert handler.received_blocks == 0 and b.usage() == (0, 0)


def test_a_store_of_another_format_refuses_the_transfer(tmp_path: Path) -> None:
    a, b, blocks = _stores(tmp_path, fmt_b="other")

    async def body(addr: str):
        with pytest.raises(TransferRejected, match="format"):
            await _push(a, blocks, addr)

    _run(b, body, fmt="other")
    assert b.usage() == (0, 0)


def test_a_damaged_block_is_refused_and_not_written(tmp_path: Path) -> None:
    """A frame whose bytes do not match its crc32 (authenticated, so damaged before sealing)."""
    a, b, blocks = _stores(tmp_path)
    blk = blocks[0]
    raw = a.get(blk.key, parent=blk.parent, tokens=TOKENS[:16])
    payload = bytearray(raw.tobytes())
    header = {"kind": "kv", "codec": "fp32", "block": {
        "key": blk.key.hex(), "parent": blk.parent.hex(), "tokens": TOKENS[:16], "dtype": raw.dtype.str,
        "shape": list(raw.shape), "crc32": zlib.crc32(payload)}}
    payload[7] ^= 0xFF

    async def body(addr: str):
        sender = await open_sender(addr, "t3", codec="fp32", key=KEY, timeout=5,
                                   meta={"fmt": "fmt", "pin": "p", "ttl": 60, "keys": [blk.key.hex()]})
        with pytest.raises(TransferError, match="damaged"):
            await sender.send(Frame(header, bytes(payload)))
            await sender.finish()

    _, handler, _ = _run(b, body)
    assert not b.contains(blk.key) and handler.failed_transfers == 1


def test_a_block_evicted_at_the_source_aborts_the_push(tmp_path: Path) -> None:
    a, b, blocks = _stores(tmp_path)
    (a.blocks / blocks[1].key.hex()).unlink()

    async def body(addr: str):
        with pytest.raises(LookupError, match="left the store"):
            await _push(a, blocks, addr)

    _, handler, _ = _run(b, body)
    assert handler.failed_transfers == 1


def test_only_lossless_codecs_carry_vllm_kv() -> None:
    assert transfer_codec("torch.float32") == "fp32"
    with pytest.raises(ValueError, match="float16"):
        transfer_codec("torch.float16")


def test_a_push_reports_how_long_it_took(tmp_path: Path) -> None:
    a, b, blocks = _stores(tmp_path)
    started = time.monotonic()
    pushed, _, _ = _run(b, lambda addr: _push(a, blocks, addr))
    assert 0 < pushed.seconds <= time.monotonic() - started


def test_an_open_meta_with_any_one_field_malformed_is_refused(tmp_path: Path) -> None:
    """pin not a string, ttl not a number (even one that parses), keys not a list (even a mapping
    of valid keys): each alone refuses the transfer, and nothing is pinned."""
    _, b, blocks = _stores(tmp_path)
    good = {"fmt": "fmt", "pin": "p", "ttl": 60, "keys": [blocks[0].key.hex()]}
    bad = [{"pin": 7}, {"pin": ["p"]}, {"ttl": "60"}, {"ttl": None}, {"keys": {blocks[0].key.hex(): 1}}]

    async def body(addr: str):
        for i, change in enumerate(bad):
            with pytest.raises(TransferRejected, match="open meta needs"):
                await open_sender(addr, f"m{i}", codec="fp32", key=KEY, timeout=5, meta={**good, **change})
        sender = await open_sender(addr, "ok", codec="fp32", key=KEY, timeout=5, meta=good)
        await sender.finish()

    _run(b, body)
    assert [p.name for p in b.pins.iterdir()] == ["p"]  # the well-formed one only


async def _until(check, seconds: float = 2.0) -> None:
    """Wait (briefly) for the receiver to have handled what the sender already sent."""
    async def poll():
        while not check():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), seconds)


def test_every_failed_push_is_counted_with_the_senders_reason(tmp_path: Path, caplog) -> None:
    a, b, blocks = _stores(tmp_path)
    (a.blocks / blocks[1].key.hex()).unlink()

    async def main():
        handler = StoreReceiver(b, "fmt")
        receiver = KVReceiver(handler, key=KEY)
        await receiver.start()
        try:
            for n in (1, 2):
                with pytest.raises(LookupError):
                    await _push(a, blocks, receiver.address("tcp"))
                await _until(lambda n=n: handler.failed_transfers == n)
        finally:
            await receiver.close()
        return handler

    with caplog.at_level("WARNING", logger="agentshare.vllm.relay"):
        handler = asyncio.run(main())
    assert handler.failed_transfers == 2
    errors = [r.error for r in caplog.records if getattr(r, "event", None) == "vllm_push_failed"]
    assert len(errors) == 2
    assert all("LookupError: store block " + blocks[1].key.hex()[:16] in e and "left the store" in e for e in errors)


def test_a_push_to_a_node_that_never_answers_times_out(tmp_path: Path) -> None:
    a, _, blocks = _stores(tmp_path)

    async def main():
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # reads everything, answers nothing
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            started = time.monotonic()
            with pytest.raises(TransferTimeout):
                await push_blocks(a, blocks, TOKENS, address=f"tcp://127.0.0.1:{port}", key=KEY, fmt="fmt",
                                  codec="fp32", pin="p", ttl=60, transfer_id="t9", timeout=0.1)
            return time.monotonic() - started
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(asyncio.wait_for(main(), 5)) < 2  # the push's timeout, not the transport's default


def test_a_tensor_parallel_prefix_travels_every_ranks_part(tmp_path: Path) -> None:
    a = KVStore(tmp_path / "a", fmt="fmt", capacity_bytes=1 << 20, role="a", parts=2)
    b = KVStore(tmp_path / "b", fmt="fmt", capacity_bytes=1 << 20, role="b", parts=2)
    blocks = prefix_blocks(TOKENS, family=FAMILY, salt="tenant", block_size=16)
    for blk in blocks:
        for part in (0, 1):
            a.put(blk.key, parent=blk.parent, tokens=TOKENS[blk.start:blk.end],
                  kv=np.full((2, 1, 4), part, np.uint8), part=part)
    pushed, handler, _ = _run(b, lambda addr: _push(a, blocks, addr))
    assert (pushed.blocks, handler.received_blocks) == (3, 6)  # blocks sent; frames received
    for blk in blocks:
        assert b.contains(blk.key)
        for part in (0, 1):
            got = b.get(blk.key, parent=blk.parent, tokens=TOKENS[blk.start:blk.end], part=part)
            assert got is not None and (got == part).all()


@pytest.mark.parametrize("part", [-1, 1, "x"])
def test_a_frame_for_a_rank_the_store_has_not_is_refused(tmp_path: Path, part) -> None:
    _, b, blocks = _stores(tmp_path)
    blk = blocks[0]
    payload = bytes(8)
    header = {"kind": "kv", "codec": "fp32", "block": {
        "key": blk.key.hex(), "parent": blk.parent.hex(), "tokens": TOKENS[:16], "part": part, "dtype": "|u1",
        "shape": [8], "crc32": zlib.crc32(payload)}}

    async def body(addr: str):
        sender = await open_sender(addr, "t4", codec="fp32", key=KEY, timeout=5,
                                   meta={"fmt": "fmt", "pin": "p", "ttl": 60, "keys": [blk.key.hex()]})
        with pytest.raises(TransferError, match="part"):
            await sender.send(Frame(header, payload))
            await sender.finish()

    _, handler, _ = _run(b, body)
    assert not b.contains(blk.key) and handler.failed_transfers == 1
