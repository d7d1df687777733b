"""The sending end of one transfer over one TCP connection, payloads inline.

::

    sender                                           receiver (transport.KVReceiver)
    open()    connect, "open" ─────────────────────▶ on_open
              ◀──────────────────────────────────── "ack" | "error" ─▶ TransferRejected
    send(kv)  frame, write + drain (back-pressure) ─▶ on_frame   (no reply per frame)
    finish()  "end" ───────────────────────────────▶ on_end(None)
              ◀──────────────────────────────────── "ack" | "error" ─▶ TransferRejected
    abort(r)  "abort" {reason}, close ─────────────▶ on_end(reason)

A task reads the receiver's replies all along, so an ``error`` (a checksum failure, a full
pool) stops the next ``send()`` instead of after the whole context has been pushed. Every
frame, both ways, carries its HMAC tag under ``key`` (``wire.Seal``), bound to the transfer
once ``open`` is written.
``shm.ShmSender`` reuses all of this and only moves the payloads elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, ClassVar, Self

from server.cluster.codec import Frame
from server.cluster.errors import (
    ProtocolError,
    TransferClosed,
    TransferError,
    TransferRejected,
    TransferTimeout,
    Unauthenticated,
)
from server.cluster.wire import DATA, REPLY, LinkStats, Seal, control, read_frame, write_frame

_OPEN_ACK, _END_ACK = 1, 2  # the plain acks a sender receives, in order


class TCPSender:
    """Sends the frames of one transfer; made by :meth:`open` (or ``transport.open_sender``).
    One task drives it: ``send``, ``finish`` and ``abort`` are not meant to run concurrently."""

    mode: ClassVar[str] = "tcp"

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        transfer_id: str,
        codec: str,
        address: str,
        timeout: float,
        key: bytes,
    ) -> None:
        self.stats = LinkStats()
        self.transfer_id = transfer_id
        self.codec = codec
        self.address = address
        self.timeout = timeout
        self._reader, self._writer = reader, writer
        self._out, self._in = Seal(key, DATA), Seal(key, REPLY)
        self._changed = asyncio.Condition()  # notified on every reply and on the end of replies
        self._acks = 0
        self._failure: TransferError | None = None
        self._closed = False
        self._replies = asyncio.create_task(self._read_replies())

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        transfer_id: str,
        *,
        codec: str,
        timeout: float,
        key: bytes,
        meta: dict[str, Any] | None = None,
    ) -> Self:
        """Connect, send ``open`` and wait for the receiver to accept the transfer; ``key`` is
        the cluster's KV key (``ClusterSecret.kv_key()``)."""
        address = f"{cls.mode}://{host}:{port}"
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except TimeoutError as exc:
            raise TransferTimeout(
                f"connecting to the KV receiver at {address} took over {timeout}s"
            ) from exc
        except OSError as exc:
            raise TransferClosed(
                f"cannot connect to the KV receiver at {address}: {exc.strerror or exc}"
            ) from exc
        sender = cls(
            reader, writer, transfer_id=transfer_id, codec=codec, address=address, timeout=timeout,
            key=key,
        )
        sender.stats.seconds += loop.time() - started
        # The receiver binds both directions to the transfer once it has read "open", so every
        # reply is bound: bind ours before writing it (the ack may be read before the write
        # returns: uvloop sends at once). "open" itself is sealed unbound, ours after it.
        sender._in.bind(transfer_id)
        try:
            await sender._write(
                control(
                    "open",
                    transfer_id=transfer_id,
                    codec=codec,
                    mode=cls.mode,
                    meta=meta or {},
                    **sender._open_fields(),
                )
            )
            sender._out.bind(transfer_id)
            await sender._wait(lambda: sender._acks >= _OPEN_ACK, "accept the transfer")
        except BaseException:
            sender.stats.failures += 1
            await sender._close()
            raise
        return sender

    async def send(self, frame: Frame) -> None:
        """Send a ``kv`` frame from ``codec.encode``. Raises the receiver's error as soon as it
        has failed the transfer; after any error the sender is closed (``abort`` is a no-op)."""
        if frame.header.get("kind") != "kv" or frame.header.get("codec") != self.codec:
            raise ValueError(
                f"send() takes kv frames of codec {self.codec}, got {frame.header.get('kind')!r} "
                f"of codec {frame.header.get('codec')!r}"
            )
        if self._closed:
            raise TransferClosed(f"transfer {self.transfer_id} to {self.address} is already over")
        try:
            if self._failure is not None:
                raise self._failure
            await self._send_kv(frame)
        except BaseException:
            self.stats.failures += 1
            await self._close()
            raise

    async def finish(self) -> None:
        """Send ``end`` and wait for the receiver's ``ack``: the transfer is then complete."""
        if self._closed:
            raise TransferClosed(f"transfer {self.transfer_id} to {self.address} is already over")
        try:
            if self._failure is not None:
                raise self._failure
            await self._write(control("end"))
            await self._wait(lambda: self._acks >= _END_ACK, "complete the transfer")
        except BaseException:
            self.stats.failures += 1
            raise
        else:
            self.stats.transfers += 1
        finally:
            await self._close()

    async def abort(self, reason: str) -> None:
        """Tell the receiver to drop the transfer and close; never raises."""
        if self._closed:
            return
        self.stats.failures += 1
        # Tell the receiver why, unless it failed the transfer itself or is not reading (frames
        # still queued here): then closing says enough, and abort must not wait on a stalled peer.
        if self._failure is None and not self._writer.transport.get_write_buffer_size():
            with contextlib.suppress(Exception):
                await self._write(control("abort", reason=reason))
        await self._close()

    # -- what subclasses change ---------------------------------------------------------------

    def _open_fields(self) -> dict[str, Any]:
        """Extra fields of the ``open`` frame."""
        return {}

    async def _send_kv(self, frame: Frame) -> None:
        await self._write(frame)

    def _on_ack(self, seq: int) -> None:
        raise ProtocolError(
            f"the receiver at {self.address} acknowledged payload {seq} of a tcp transfer"
        )

    def _cleanup(self) -> None:
        """Release what the transfer held outside the connection (called once, on close)."""

    # -- plumbing -----------------------------------------------------------------------------

    async def _write(self, frame: Frame) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            self.stats.bytes += await asyncio.wait_for(
                write_frame(self._writer, frame, self._out), self.timeout
            )
            self.stats.frames += 1
        except TimeoutError as exc:
            raise TransferTimeout(
                f"the KV receiver at {self.address} took no data for {self.timeout}s "
                f"(transfer {self.transfer_id})"
            ) from exc
        except TransferClosed:
            # the receiver may have said why before closing: give the reply reader a moment
            await asyncio.wait({self._replies}, timeout=min(self.timeout, 1.0))
            if self._failure is not None:
                raise self._failure from None
            raise
        finally:
            self.stats.seconds += loop.time() - started

    async def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait until ``ready()`` (re-checked on every reply) or the transfer failed."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with self._changed:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: ready() or self._failure is not None),
                    self.timeout,
                )
        except TimeoutError as exc:
            raise TransferTimeout(
                f"the KV receiver at {self.address} did not {what} within {self.timeout}s "
                f"(transfer {self.transfer_id})"
            ) from exc
        finally:
            self.stats.seconds += loop.time() - started
        if not ready():
            assert self._failure is not None
            raise self._failure

    async def _read_replies(self) -> None:
        failure: TransferError | None = None
        try:
            while failure is None:
                header = (await read_frame(self._reader, self._in, max_header=1 << 16, max_payload=0)).header
                kind = header.get("kind")
                if kind == "ack" and "seq" in header:
                    self._on_ack(header["seq"])
                elif kind == "ack":
                    self._acks += 1
                elif kind == "error":
                    failure = TransferRejected(
                        f"the KV receiver at {self.address} rejected transfer {self.transfer_id}: "
                        f"{header.get('message')}"
                    )
                else:
                    failure = ProtocolError(
                        f"unexpected {kind!r} frame from the KV receiver at {self.address}"
                    )
                async with self._changed:
                    self._changed.notify_all()
        except TransferClosed as exc:
            if self._acks < _END_ACK:
                failure = TransferClosed(
                    f"the KV receiver at {self.address} closed the connection during transfer "
                    f"{self.transfer_id} ({exc})"
                )
        except Unauthenticated as exc:
            failure = Unauthenticated(
                f"a reply of the KV receiver at {self.address} failed authentication ({exc}): the two ends "
                "do not hold the same cluster secret"
            )
        except TransferError as exc:
            failure = exc
        finally:
            if self._failure is None:
                self._failure = failure
            async with self._changed:
                self._changed.notify_all()

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._replies.cancel()
        if self._writer.transport.get_write_buffer_size():
            self._writer.transport.abort()  # unsent frames of a transfer that is over: drop them
        else:
            self._writer.close()
        with contextlib.suppress(OSError, TimeoutError):  # the connection is gone either way
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        await asyncio.wait({self._replies})
        self._cleanup()
