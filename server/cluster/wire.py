"""Framing of :class:`~server.cluster.codec.Frame` on an asyncio byte stream, and link counters.

One frame on the wire (integers little-endian, like the payloads)::

    "ASKV" | u8 version | u32 header_len | u64 payload_len | header: UTF-8 JSON | payload
    └────────────── 17-byte prefix ───────────────────┘

Control frames carry an empty payload and a ``kind``: ``open`` {transfer_id, codec, mode,
meta}, ``kv`` (from ``codec.encode``, or with ``shm`` {name, length} and ``seq`` instead of an
inline payload), ``end``, ``abort`` {reason}, ``ack`` ({seq} for an shm payload), ``error``
{message}.

>>> import asyncio
>>> async def parse(data: bytes) -> Frame:
...     reader = asyncio.StreamReader()
...     reader.feed_data(data)
...     reader.feed_eof()
...     return await read_frame(reader)
>>> asyncio.run(parse(PREFIX.pack(MAGIC, VERSION, 15, 3) + b'{"kind":"ping"}' + b"abc"))
Frame(header={'kind': 'ping'}, payload=bytearray(b'abc'))
"""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass
from typing import Any

from server.cluster.codec import Frame
from server.cluster.errors import ProtocolError, TransferClosed

MAGIC = b"ASKV"
VERSION = 1
PREFIX = struct.Struct("<4sBIQ")


@dataclass(slots=True)
class LinkStats:
    """Counters of one link, in the data direction (sender to receiver) on both ends, so the two
    ends agree: frames sent/read and their wire bytes (prefix + header + payload), plus the
    payload bytes that went through shared memory instead."""

    bytes: int = 0
    frames: int = 0
    transfers: int = 0
    """Transfers completed (the receiver acknowledged ``end``)."""
    failures: int = 0
    """Transfers that ended otherwise (abort, error, dropped connection, timeout)."""
    seconds: float = 0.0
    """Time spent moving the transfers' frames (not the gaps while the sender computes)."""

    @property
    def throughput(self) -> float:
        """Bytes per second, 0.0 before any timed traffic."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def control(kind: str, **fields: Any) -> Frame:
    """A control frame (no payload)."""
    return Frame({"kind": kind, **fields}, b"")


async def write_frame(writer: asyncio.StreamWriter, frame: Frame) -> int:
    """Write ``frame``, wait for the transport to drain (back-pressure); returns bytes written."""
    try:
        header = json.dumps(frame.header, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"frame header is not JSON-safe: {exc}") from exc
    payload_len = memoryview(frame.payload).nbytes
    try:
        writer.write(PREFIX.pack(MAGIC, VERSION, len(header), payload_len) + header)
        if payload_len:
            writer.write(frame.payload)  # not concatenated: the payload may be megabytes
        await writer.drain()
    except ConnectionError as exc:
        raise TransferClosed(
            f"the peer closed the connection while we wrote a frame: {exc}"
        ) from exc
    return PREFIX.size + len(header) + payload_len


async def receive_frame(
    reader: asyncio.StreamReader, *, max_header: int = 1 << 20, max_payload: int = 1 << 31
) -> tuple[Frame, int, float]:
    """Read one frame; returns it, its wire bytes, and the seconds from its prefix to its end
    (the wait for the prefix is the sender's idle time, not the link's)."""
    loop = asyncio.get_running_loop()
    prefix = await _read_exactly(reader, PREFIX.size, "frame prefix")
    started = loop.time()
    magic, version, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad magic {magic!r}: not an agentshare KV stream (expected {MAGIC!r})"
        )
    if version != VERSION:
        raise ProtocolError(f"unsupported KV wire version {version} (this side speaks {VERSION})")
    if header_len > max_header:
        raise ProtocolError(f"frame header of {header_len} bytes exceeds the limit of {max_header}")
    if payload_len > max_payload:
        raise ProtocolError(
            f"frame payload of {payload_len} bytes exceeds the limit of {max_payload}"
        )
    raw = await _read_exactly(reader, header_len, "frame header")
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"frame header must be a JSON object, got {type(header).__name__}")
    payload = await _read_into(reader, payload_len)
    return Frame(header, payload), PREFIX.size + header_len + payload_len, loop.time() - started


async def read_frame(
    reader: asyncio.StreamReader, *, max_header: int = 1 << 20, max_payload: int = 1 << 31
) -> Frame:
    """Read one frame (payload as a writable ``bytearray``).

    Raises :class:`ProtocolError` on a bad prefix, an oversize part or invalid JSON, and
    :class:`TransferClosed` when the stream ends first.
    """
    frame, _, _ = await receive_frame(reader, max_header=max_header, max_payload=max_payload)
    return frame


async def _read_exactly(reader: asyncio.StreamReader, n: int, what: str) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        got = len(exc.partial)
        raise TransferClosed(
            "the peer closed the connection"
            if got == 0 and what == "frame prefix"
            else f"the stream ended after {got} of the {n} bytes of a {what}"
        ) from exc
    except ConnectionError as exc:
        raise TransferClosed(f"the connection broke while reading a {what}: {exc}") from exc


async def _read_into(reader: asyncio.StreamReader, n: int) -> bytearray:
    """The next ``n`` bytes in a writable buffer (``readexactly`` would return read-only bytes,
    which torch can only view with a warning, after one more copy)."""
    payload = bytearray(n)
    view, pos = memoryview(payload), 0
    try:
        while pos < n:
            chunk = await reader.read(n - pos)
            if not chunk:
                raise TransferClosed(
                    f"the stream ended after {pos} of the {n} bytes of a frame payload"
                )
            view[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
    except ConnectionError as exc:
        raise TransferClosed(f"the connection broke while reading a frame payload: {exc}") from exc
    return payload
