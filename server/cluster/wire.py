"""Framing of :class:`~server.cluster.codec.Frame` on an asyncio byte stream, its authentication,
and link counters.

One frame on the wire (integers little-endian, like the payloads)::

    "ASKV" | u8 version | u32 header_len | u64 payload_len | header: UTF-8 JSON | payload | tag
    └────────────── 17-byte prefix ───────────────────┘                                 32 bytes

``tag`` is HMAC-SHA256, under the cluster's KV key, of everything before it, preceded by the
frame's direction (data or reply), its transfer (the id, once ``open`` has named it) and its
number on the connection (:class:`Seal`). A frame cannot be forged without the key, nor moved
to another transfer, direction or place in the stream. The reader checks the tag, in constant
time, before it parses the header; the first frame of a connection may carry no payload, so a
peer without the key gets nothing past a header's bytes read and refused.

Control frames carry an empty payload and a ``kind``: ``open`` {transfer_id, codec, mode,
meta}, ``kv`` (from ``codec.encode``, or with ``shm`` {name, length, mac} and ``seq`` instead
of an inline payload), ``end``, ``abort`` {reason}, ``ack`` ({seq} for an shm payload),
``error`` {message}.

>>> import asyncio
>>> async def round_trip(frame: Frame) -> Frame:
...     reader = asyncio.StreamReader()
...     class Sink:  # a writer that feeds the reader
...         def write(self, data): reader.feed_data(bytes(data))
...         async def drain(self): pass
...     await write_frame(Sink(), frame, Seal(b"k" * 32, DATA))
...     return await read_frame(reader, Seal(b"k" * 32, DATA))
>>> asyncio.run(round_trip(Frame({"kind": "ping"}, b"abc")))
Frame(header={'kind': 'ping'}, payload=bytearray(b'abc'))
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any, Protocol

from server.cluster.codec import Frame
from server.cluster.errors import ProtocolError, TransferClosed, Unauthenticated

MAGIC = b"ASKV"
VERSION = 2  # 1: no tag
PREFIX = struct.Struct("<4sBIQ")
TAG = hashlib.sha256().digest_size
DATA, REPLY = b"data", b"reply"  # sender -> receiver, receiver -> sender
_THREAD_MIN = 1 << 18  # hash payloads this large off the event loop (hashlib releases the GIL)


class Writer(Protocol):
    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    async def drain(self) -> None: ...


class Seal:
    """The HMAC tags of the frames going one way on one connection. Both ends keep one per
    direction and count frames alike; ``bind`` names the transfer once ``open`` has passed.

    >>> a, b = Seal(b"k" * 32, DATA), Seal(b"k" * 32, DATA)
    >>> tag = a.start(b"frame").digest()
    >>> b.verify(b.start(b"frame"), tag), b.verify(b.start(b"frame"), tag)  # the 2nd is frame 1
    (True, False)
    """

    __slots__ = ("_key", "count", "direction", "transfer")

    def __init__(self, key: bytes, direction: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a KV key has at least 16 bytes (ClusterSecret.kv_key())")
        self._key, self.direction, self.transfer, self.count = key, direction, b"", 0

    def bind(self, transfer_id: str) -> None:
        self.transfer = transfer_id.encode()

    def start(self, data: bytes) -> hmac.HMAC:
        """The MAC of the next frame, fed with ``data`` (its prefix and header); feed the payload."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(self.direction + struct.pack("<QI", self.count, len(self.transfer)) + self.transfer)
        mac.update(data)
        self.count += 1
        return mac

    def payload_mac(self, payload: bytes | bytearray | memoryview, seq: int) -> str:
        """The MAC of a payload that travels apart from its frame (shared memory), hex."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(b"payload" + struct.pack("<QI", seq, len(self.transfer)) + self.transfer)
        mac.update(payload)
        return mac.hexdigest()

    @staticmethod
    def verify(mac: hmac.HMAC, tag: bytes | str) -> bool:
        if isinstance(tag, str):
            return hmac.compare_digest(mac.hexdigest(), tag)
        return hmac.compare_digest(mac.digest(), tag)


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


async def write_frame(writer: Writer, frame: Frame, seal: Seal) -> int:
    """Write ``frame`` and its tag, wait for the transport to drain (back-pressure); returns
    bytes written."""
    try:
        header = json.dumps(frame.header, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"frame header is not JSON-safe: {exc}") from exc
    payload_len = memoryview(frame.payload).nbytes
    head = PREFIX.pack(MAGIC, VERSION, len(header), payload_len) + header
    mac = seal.start(head)
    try:
        writer.write(head)
        if payload_len:
            writer.write(frame.payload)  # not concatenated: the payload may be megabytes
            if payload_len >= _THREAD_MIN:  # the loop sends what was written meanwhile
                await asyncio.to_thread(mac.update, frame.payload)
            else:
                mac.update(frame.payload)
        writer.write(mac.digest())
        await writer.drain()
    except ConnectionError as exc:
        raise TransferClosed(
            f"the peer closed the connection while we wrote a frame: {exc}"
        ) from exc
    return PREFIX.size + len(header) + payload_len + TAG


async def receive_frame(
    reader: asyncio.StreamReader, seal: Seal, *, max_header: int = 1 << 20, max_payload: int = 1 << 31
) -> tuple[Frame, int, float]:
    """Read one frame and check its tag; returns it, its wire bytes, and the seconds from its
    prefix to its end (the wait for the prefix is the sender's idle time, not the link's).

    Raises :class:`Unauthenticated` on a missing or wrong tag (or a wire version without one),
    before the header is parsed."""
    loop = asyncio.get_running_loop()
    prefix = await _read_exactly(reader, PREFIX.size, "frame prefix")
    started = loop.time()
    magic, version, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad magic {magic!r}: not an agentshare KV stream (expected {MAGIC!r})"
        )
    if version != VERSION:
        raise Unauthenticated(f"KV wire version {version} carries no valid authentication (this side speaks "
                              f"{VERSION}: HMAC-tagged frames under the cluster secret)")
    if header_len > max_header:
        raise ProtocolError(f"frame header of {header_len} bytes exceeds the limit of {max_header}")
    if payload_len > max_payload:
        raise ProtocolError(
            f"frame payload of {payload_len} bytes exceeds the limit of {max_payload}"
        )
    raw = await _read_exactly(reader, header_len, "frame header")
    mac = seal.start(prefix + raw)
    payload = await _read_into(reader, payload_len, mac)
    if not seal.verify(mac, await _read_exactly(reader, TAG, "frame tag")):
        raise Unauthenticated("a KV frame failed authentication (wrong HMAC): the peer does not hold this "
                              "cluster's secret, or the frame was altered or replayed")
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"frame header must be a JSON object, got {type(header).__name__}")
    return Frame(header, payload), PREFIX.size + header_len + payload_len + TAG, loop.time() - started


async def read_frame(
    reader: asyncio.StreamReader, seal: Seal, *, max_header: int = 1 << 20, max_payload: int = 1 << 31
) -> Frame:
    """Read one frame (payload as a writable ``bytearray``).

    Raises :class:`Unauthenticated` on a bad tag, :class:`ProtocolError` on a bad prefix, an
    oversize part or invalid JSON, and :class:`TransferClosed` when the stream ends first.
    """
    frame, _, _ = await receive_frame(reader, seal, max_header=max_header, max_payload=max_payload)
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


async def _read_into(reader: asyncio.StreamReader, n: int, mac: hmac.HMAC) -> bytearray:
    """The next ``n`` bytes in a writable buffer (``readexactly`` would return read-only bytes,
    which torch can only view with a warning, after one more copy), fed to ``mac`` as they
    come (large pieces off the loop, which meanwhile reads the next)."""
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
            if len(chunk) >= _THREAD_MIN:
                await asyncio.to_thread(mac.update, chunk)
            else:
                mac.update(chunk)
    except ConnectionError as exc:
        raise TransferClosed(f"the connection broke while reading a frame payload: {exc}") from exc
    return payload
