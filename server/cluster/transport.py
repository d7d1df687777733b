"""Moving KV between processes: the sender and receiver interfaces, and their dispatch.

::

    prefill worker                                       decode worker
    s = await open_sender("shm://h:p", tid, codec=c,     KVReceiver(handler, key=k).start()
                          key=k)
    await s.send(encode(chunk, c, block_size=B)) ──────▶ on_open, on_frame..., on_end
    await s.finish()       # acked: the KV is in         (one connection per transfer)

``tcp://`` carries payloads inline (any host); ``shm://`` carries the same control frames over
TCP and the payloads through shared memory (same host only). One receiver serves both. Both
ends hold the cluster's KV key (``ClusterSecret.kv_key()``): every frame carries its HMAC, and a
connection whose frame fails it is refused and counted (``KVReceiver.refused``). Errors
(``errors.py``, re-exported here)::

    TransferError ── ProtocolError (── Unauthenticated) · CorruptPayload · TransferClosed
                  └─ TransferRejected · TransferTimeout

>>> import asyncio, torch
>>> from server.cluster.codec import Codec, KVChunk, decode, encode
>>> class Keep:
...     async def on_open(self, transfer_id, header): self.blocks = 0
...     async def on_frame(self, transfer_id, frame):
...         self.blocks += decode(frame, dtype=torch.float32).k.shape[2] // 4
...     async def on_end(self, transfer_id, error): self.error = error
>>> key = b"k" * 32
>>> async def demo(handler):
...     receiver = KVReceiver(handler, key=key)
...     await receiver.start()
...     sender = await open_sender(receiver.address("shm"), "t1", codec=Codec.INT8, key=key)
...     kv = torch.ones(2, 2, 8, 4)  # 2 blocks of 4 tokens
...     await sender.send(encode(KVChunk(0, kv, kv), Codec.INT8, block_size=4))
...     await sender.finish()
...     await receiver.close()
...     return sender.stats.frames, handler.blocks, handler.error
>>> asyncio.run(demo(Keep()))
(3, 2, None)
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from server.cluster import codecs
from server.cluster.codec import Frame, codec_of
from server.cluster.errors import (
    CorruptPayload,
    ProtocolError,
    TransferClosed,
    TransferError,
    TransferRejected,
    TransferTimeout,
    Unauthenticated,
)
from server.cluster.shm import ShmSender, read_payload, shm_dir, take_probe
from server.cluster.tcp import TCPSender
from server.cluster.wire import DATA, REPLY, LinkStats, Seal, control, receive_frame, write_frame

__all__ = [
    "CorruptPayload",
    "KVReceiver",
    "KVSender",
    "LinkStats",
    "ProtocolError",
    "ReceiveHandler",
    "TransferClosed",
    "TransferError",
    "TransferRejected",
    "TransferTimeout",
    "Unauthenticated",
    "open_sender",
]

log = logging.getLogger("agentshare.cluster")

_SENDERS: dict[str, type[TCPSender]] = {"tcp": TCPSender, "shm": ShmSender}
# the receiving stream buffers up to this much before pausing the socket: big enough that a
# multi-megabyte payload is not read in 64 KiB pause/resume steps
_STREAM_LIMIT = 1 << 22


class ReceiveHandler(Protocol):
    """What a receiver calls, per transfer and in order: ``on_open``, ``on_frame``*, ``on_end``."""

    async def on_open(self, transfer_id: str, header: dict[str, Any]) -> None:
        """Accept the transfer, or raise: the sender gets ``TransferRejected`` with the message."""

    async def on_frame(self, transfer_id: str, frame: Frame) -> None:
        """A ``kv`` frame with its payload inline (copied out of shared memory if need be). Raising
        fails the transfer: the sender is told, then ``on_end`` gets the error."""

    async def on_end(self, transfer_id: str, error: str | None) -> None:
        """Exactly once per accepted transfer: ``None`` after ``end`` (raising then fails the
        transfer), else why it failed (abort, dropped connection, timeout, ``on_frame`` error)."""


class KVSender(Protocol):
    """The sending end of one transfer (``tcp.TCPSender`` or ``shm.ShmSender``)."""

    stats: LinkStats

    async def send(self, frame: Frame) -> None: ...

    async def finish(self) -> None: ...

    async def abort(self, reason: str) -> None: ...


async def open_sender(
    address: str,
    transfer_id: str,
    *,
    codec: str,
    key: bytes,
    timeout: float = 10.0,
    meta: dict[str, Any] | None = None,
) -> KVSender:
    """Open a transfer to the receiver at ``tcp://host:port`` or ``shm://host:port``.

    ``codec`` is a registered codec's name (:mod:`server.cluster.codecs`), the one every frame
    sent must be encoded with.
    ``key`` is the cluster's KV key (the receiver's). ``timeout`` bounds the connect, each
    write and each awaited reply. ``meta`` (JSON-safe) reaches the receiver's ``on_open`` as
    ``header["meta"]``.
    """
    parts = urlsplit(address)
    if parts.scheme not in _SENDERS or not parts.hostname or parts.port is None:
        raise ValueError(
            f"KV receiver address must be tcp://host:port or shm://host:port, got {address!r}"
        )
    sender_cls = _SENDERS[parts.scheme]
    return await sender_cls.open(
        parts.hostname, parts.port, transfer_id, codec=codecs.get(codec).name, timeout=timeout,
        key=key, meta=meta,
    )


class KVReceiver:
    """Listens on ``host:port`` (0: an ephemeral port); one connection per transfer; serves both
    TCP and shm senders. ``stats`` are keyed ``"<mode>://<peer host>"``: one link per peer and
    kind, summed over its transfers. ``refused`` counts connections whose frames failed
    authentication under ``key`` (nothing of theirs reached the handler after that)."""

    def __init__(
        self,
        handler: ReceiveHandler,
        *,
        key: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        idle_timeout: float = 30.0,
        max_payload: int = 1 << 31,
    ) -> None:
        self.handler, self.host, self.port = handler, host, port
        self.idle_timeout, self.max_payload = idle_timeout, max_payload
        Seal(key, DATA)  # refuses a short key now, not on the first connection
        self._key = key
        self.stats: dict[str, LinkStats] = {}
        self.refused = 0
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=_STREAM_LIMIT
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def address(self, kind: str = "tcp") -> str:
        """Where senders reach this receiver (``host`` as given: advertise a routable one)."""
        if kind not in _SENDERS:
            raise ValueError(f"unknown transport {kind!r}; expected one of {', '.join(_SENDERS)}")
        if self._server is None:
            raise RuntimeError("start() the KV receiver before asking its address")
        return f"{kind}://{self.host}:{self.port}"

    async def close(self) -> None:
        """Stop listening and fail the transfers in progress (their ``on_end`` gets an error)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve_connection(reader, writer)
        except asyncio.CancelledError:
            pass  # close(): the connection task ends here (asyncio 3.11 logs cancelled ones)
        finally:
            self._connections.discard(task)

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer = writer.get_extra_info("peername")
        state = _Connection(str(peer[0]) if peer else "unknown", Seal(self._key, DATA), Seal(self._key, REPLY))
        drain = False
        try:
            await self._transfer(reader, writer, state)
        except Exception as exc:  # one bad connection must not stop the receiver
            state.error = _describe(exc)
            state.settle(ok=False)  # before telling the sender, who may look at our stats next
            if isinstance(exc, Unauthenticated):
                self.refused += 1
                log.warning("KV frames refused", extra={"event": "kv_refused", "peer": state.peer, "error": str(exc)})
            elif not isinstance(exc, TransferError):
                log.warning("KV transfer from %s failed in the handler", state.peer, exc_info=exc)
            if not isinstance(exc, TransferClosed):
                await _tell(writer, control("error", message=state.error), state.reply)
                drain = True
        finally:
            state.settle(ok=False)
            if state.opened is not None:
                try:
                    await self.handler.on_end(state.opened, state.error)
                except Exception:
                    log.warning("on_end of KV transfer %s raised", state.opened, exc_info=True)
            if drain:
                await _drain_input(reader)
            writer.close()

    async def _transfer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _Connection
    ) -> None:
        """One transfer, from ``open`` to ``end`` or ``abort``; raises on anything else."""
        # "open" has no payload: a peer without the key gets no more than a header read
        frame, nbytes, seconds = await self._next(reader, state, max_payload=0)
        transfer_id, mode, codec = _check_open(frame.header)
        state.data.bind(transfer_id)
        state.reply.bind(transfer_id)
        if mode == "shm" and not take_probe(frame.header.get("shm_probe")):
            raise ProtocolError(
                f"shm:// needs the sender on this host, but its probe file is not in {shm_dir()} "
                "here: use a tcp:// address across hosts"
            )
        link = state.link = self.stats.setdefault(f"{mode}://{state.peer}", LinkStats())
        _count(link, nbytes, seconds)
        try:
            await self.handler.on_open(transfer_id, frame.header)
        except Exception as exc:  # any refusal goes back to the sender
            state.settle(ok=False)
            await _tell(writer, control("error", message=_describe(exc)), state.reply)
            return
        state.opened = transfer_id
        await self._reply(writer, control("ack"), state.reply)
        missing: str | None = None  # a withdrawn shm payload: no more on_frame, fail unless aborted
        while True:
            frame, nbytes, seconds = await self._next(reader, state)
            _count(link, nbytes, seconds)
            header = frame.header
            kind = header.get("kind")
            if kind == "kv":
                if header.get("codec") != codec:
                    raise ProtocolError(
                        f"kv frame of codec {header.get('codec')!r} in a {codec} transfer"
                    )
                if "shm" in header:
                    copied = await self._copy_out(writer, header, frame, mode, link, state)
                    if copied is None:
                        missing = missing or (
                            f"shared-memory payload {header['shm']['name']} was gone before the "
                            "receiver read it"
                        )
                    frame = copied or frame
                if missing is None:
                    await self.handler.on_frame(transfer_id, frame)
            elif kind == "end":
                if missing is not None:
                    raise ProtocolError(missing)
                state.opened = None  # on_end is called now, whatever it does
                await self.handler.on_end(transfer_id, None)
                await self._reply(writer, control("ack"), state.reply)
                state.settle(ok=True)
                return
            elif kind == "abort":
                state.error = f"the sender aborted the transfer: {header.get('reason')}"
                return
            else:
                raise ProtocolError(f"unexpected {kind!r} frame in transfer {transfer_id}")

    async def _next(
        self, reader: asyncio.StreamReader, state: _Connection, *, max_payload: int | None = None
    ) -> tuple[Frame, int, float]:
        limit = self.max_payload if max_payload is None else max_payload
        try:
            return await asyncio.wait_for(
                receive_frame(reader, state.data, max_payload=limit), self.idle_timeout
            )
        except TimeoutError as exc:
            raise TransferTimeout(
                f"no complete frame from {state.peer} within {self.idle_timeout}s"
            ) from exc

    async def _copy_out(
        self,
        writer: asyncio.StreamWriter,
        header: dict[str, Any],
        frame: Frame,
        mode: str,
        link: LinkStats,
        state: _Connection,
    ) -> Frame | None:
        shm, seq = header.get("shm"), header.get("seq")
        if mode != "shm":
            raise ProtocolError("a shared-memory payload in a tcp transfer")
        if (
            not isinstance(shm, dict)
            or type(shm.get("name")) is not str
            or type(shm.get("length")) is not int
            or type(shm.get("mac")) is not str
        ):
            raise ProtocolError(
                f"kv header field 'shm' must be {{name: str, length: int, mac: str}}, got {shm!r}"
            )
        if type(seq) is not int or len(frame.payload):
            raise ProtocolError(
                "a shared-memory kv frame needs an integer 'seq' and no inline payload"
            )
        loop = asyncio.get_running_loop()
        started = loop.time()
        payload, mac = await asyncio.to_thread(self._take, shm["name"], shm["length"], seq, state.data)
        link.seconds += loop.time() - started
        if payload is None:  # withdrawn: the sender has closed, it awaits no ack (a write to its
            return None  # closed socket would reset the connection and lose its "abort" frame)
        if not hmac.compare_digest(mac, shm["mac"]):
            raise Unauthenticated(f"shared-memory payload {shm['name']} failed authentication (wrong HMAC): "
                                  "it is not what the sender wrote")
        link.bytes += len(payload)
        await _tell(writer, control("ack", seq=seq), state.reply)  # best effort: an "abort" may follow
        return Frame({k: v for k, v in header.items() if k not in ("shm", "seq")}, payload)

    @staticmethod
    def _take(name: str, length: int, seq: int, seal: Seal) -> tuple[bytearray | None, str]:
        """Copy a payload out of shared memory and compute its MAC (one thread, off the loop)."""
        payload = read_payload(name, length)
        return payload, "" if payload is None else seal.payload_mac(payload, seq)

    async def _reply(self, writer: asyncio.StreamWriter, frame: Frame, seal: Seal) -> None:
        try:
            await asyncio.wait_for(write_frame(writer, frame, seal), self.idle_timeout)
        except TimeoutError as exc:
            raise TransferTimeout(f"the sender took no reply for {self.idle_timeout}s") from exc


@dataclass(slots=True)
class _Connection:
    """What one connection owes: its link's counters, and the ``on_end`` of an open transfer;
    and the seals of its two directions."""

    peer: str
    data: Seal
    reply: Seal
    link: LinkStats | None = None
    opened: str | None = None
    error: str = "the receiver closed"
    settled: bool = False

    def settle(self, *, ok: bool) -> None:
        """Count the transfer once, as completed or failed (no link: nothing was opened)."""
        if self.link is None or self.settled:
            return
        self.settled = True
        if ok:
            self.link.transfers += 1
        else:
            self.link.failures += 1


def _check_open(header: dict[str, Any]) -> tuple[str, str, str]:
    if header.get("kind") != "open":
        raise ProtocolError(
            f"a transfer starts with an 'open' frame, got kind {header.get('kind')!r}"
        )
    transfer_id, mode = header.get("transfer_id"), header.get("mode")
    if not isinstance(transfer_id, str) or not transfer_id:
        raise ProtocolError(f"'open' needs a non-empty string transfer_id, got {transfer_id!r}")
    if mode not in _SENDERS:
        raise ProtocolError(f"'open' mode must be one of {', '.join(_SENDERS)}, got {mode!r}")
    return transfer_id, mode, codec_of(header).name


def _count(link: LinkStats, nbytes: int, seconds: float) -> None:
    link.bytes += nbytes
    link.frames += 1
    link.seconds += seconds


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


async def _tell(writer: asyncio.StreamWriter, frame: Frame, seal: Seal) -> None:
    """Best effort: the peer may be gone already."""
    try:
        await asyncio.wait_for(write_frame(writer, frame, seal), 1.0)
    except (TransferError, OSError, TimeoutError):
        pass


async def _drain_input(reader: asyncio.StreamReader, seconds: float = 1.0) -> None:
    """Read and drop what the sender still pushes, until it closes (or ``seconds`` pass):
    closing a socket with unread input sends a reset, which can destroy our ``error`` frame
    before the sender reads it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    try:
        while loop.time() < deadline:
            if not await asyncio.wait_for(reader.read(1 << 20), deadline - loop.time()):
                return
    except (OSError, TimeoutError):
        pass
