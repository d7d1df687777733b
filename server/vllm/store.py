"""The prefix KV store shared by the vLLM instances of one host: blocks as files in shared memory.

::

    <root>/<format>/blocks/<key hex>     one block of ``block_size`` tokens (or a prefix's tail),
                                         every layer: header (key, parent, tokens, part, dtype,
                                         shape, crc32) + raw KV bytes
    <root>/<format>/blocks/<key hex>.<r> the same, one file per tensor-parallel rank ``r`` when the
                                         instances run on several (each rank holds its heads)
    <root>/<format>/pins/<name>          keys a caller holds (a request in flight, a pinned
                                         context) until it unpins them or they expire
    <root>/<format>/stats/<role>-<pid>   one process's counters (JSON), summed by ``counters()``

Keys are the project's block keys (:mod:`server.kv.keys`): a block is found only under the
chain of everything before it, its namespace (family digest and tenant salt) and its tokens.
``<format>`` is a digest of what the bytes mean (the attention backend's KV layout, dtype,
per-token shape and tensor-parallel size): instances whose KV is laid out differently never see
each other's blocks. With ``parts`` ranks a block is held only when every rank's part is: a
rank's part alone is never reported as the prefix, and eviction removes a block's parts together.

Writes are atomic (a temporary name, then ``os.rename``); a reader checks the header against
the key, parent and token ids it expects and the payload against its crc32, and treats any
mismatch as a miss. Memory is bounded: after a write the writer evicts the least recently
used blocks (readers touch a block's mtime) until the store is within ``capacity_bytes``,
skipping pinned blocks. A block that is evicted while a reader has it open stays readable to
that reader (tmpfs frees it at the last close).

>>> import tempfile, numpy as np
>>> store = KVStore(tempfile.mkdtemp(), fmt="doc", capacity_bytes=1 << 20, role="doc")
>>> key = bytes(32)
>>> store.put(key, parent=bytes(32), tokens=[1, 2], kv=np.ones((2, 1, 2, 4), np.float32))
True
>>> store.get(key, parent=bytes(32), tokens=[1, 2]).shape
(2, 1, 2, 4)
>>> store.get(key, parent=bytes(32), tokens=[1, 3]) is None  # other tokens: a miss
True
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from server import positions
from server.kv.keys import ROOT_KEY, Layout, chain_key

log = logging.getLogger("agentshare.vllm.store")

_MAGIC = b"ASKVSTORE1"
_HEADER_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class StoreBlock:
    """One store entry of a prefix: its key, its parent's key, and positions ``[start, end)``."""

    key: bytes
    parent: bytes
    start: int
    end: int


def prefix_blocks(tokens: list[int], *, family: str, salt: str, block_size: int) -> list[StoreBlock]:
    """The store entries that hold the base's KV of ``tokens``: its full blocks, keyed as the torch
    engine keys them, then the partial tail (chained after the last full block).

    >>> bs = prefix_blocks(list(range(40)), family="f" * 64, salt="", block_size=16)
    >>> [(b.start, b.end) for b in bs]
    [(0, 16), (16, 32), (32, 40)]
    >>> bs[1].parent == bs[0].key
    True
    """
    ns = positions.layout(positions.BASE, len(tokens), family=family, salt=salt).family
    keys = Layout(ns).block_keys(tokens, block_size=block_size)
    out, parent = [], ROOT_KEY
    for i, key in enumerate(keys):
        out.append(StoreBlock(key, parent, i * block_size, (i + 1) * block_size))
        parent = key
    tail = len(keys) * block_size
    if tail < len(tokens):
        out.append(StoreBlock(chain_key(parent, ns, tokens[tail:]), parent, tail, len(tokens)))
    return out


@dataclass(slots=True)
class StoreCounters:
    """One process's store counters; every field is a monotonic total."""

    saved_blocks: int = 0
    saved_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    lookups: int = 0  # requests that asked for a shared prefix
    hit_lookups: int = 0  # ... and found all of it
    hit_tokens: int = 0  # tokens reported to vLLM as external cached tokens
    refused_lookups: int = 0  # asked by a module that may not share (another family, no manifest)
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    rejected_blocks: int = 0  # a file whose header or checksum did not match: treated as a miss
    failed_loads: int = 0  # requests whose prefix was not in the store when loaded: failed, never guessed

    def add(self, other: StoreCounters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class KVStore:
    """Blocks of prefix KV in files under ``root`` (``/dev/shm`` in production), one per key."""

    def __init__(self, root: str | os.PathLike[str], *, fmt: str, capacity_bytes: int, role: str,
                 parts: int = 1) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if parts < 1:
            raise ValueError(f"parts (tensor-parallel ranks) must be at least 1, got {parts}")
        self.fmt = fmt
        self.parts = parts
        self.dir = Path(root) / fmt
        self.blocks = self.dir / "blocks"
        self.pins = self.dir / "pins"
        self.stats_dir = self.dir / "stats"
        for d in (self.blocks, self.pins, self.stats_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.counters = StoreCounters()
        self._stats_file = self.stats_dir / f"{role}-{os.getpid()}.json"
        self._lock = threading.Lock()

    def describe(self, facts: dict[str, object]) -> None:
        """Record what the format's blocks are (block size, family, layout) for other processes."""
        path = self.dir / "config.json"
        tmp = path.with_name(f".config.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(facts))
        os.rename(tmp, path)

    # -- blocks -------------------------------------------------------------------------------

    def _path(self, key: bytes, part: int = 0) -> Path:
        if not 0 <= part < self.parts:
            raise ValueError(f"part {part} of a store of {self.parts} part(s)")
        return self.blocks / (key.hex() if self.parts == 1 else f"{key.hex()}.{part}")

    @staticmethod
    def _key_of(name: str) -> str:
        """The key (hex) a block file's name holds a part of."""
        return name.split(".", 1)[0]

    def contains(self, key: bytes) -> bool:
        """Whether every part of the block is here."""
        return all(self._path(key, part).exists() for part in range(self.parts))

    def put(self, key: bytes, *, parent: bytes, tokens: Sequence[int], kv: np.ndarray, part: int = 0) -> bool:
        """Write one block (rank ``part``'s share of it) unless it is there already; False when it was."""
        path = self._path(key, part)
        if path.exists():
            return False
        payload = np.ascontiguousarray(kv)
        header = json.dumps({
            "key": key.hex(), "parent": parent.hex(), "tokens": [int(t) for t in tokens], "part": part,
            "dtype": payload.dtype.str, "shape": list(payload.shape),
            "crc32": zlib.crc32(payload.data.cast("B")),
        }).encode()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(_MAGIC + _HEADER_LEN.pack(len(header)) + header)
            f.write(payload.data.cast("B"))
        os.rename(tmp, path)  # atomic: a reader sees the whole block or none
        with self._lock:
            self.counters.saved_blocks += 1
            self.counters.saved_bytes += payload.nbytes
        return True

    def held_prefix(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, the store holds."""
        held = 0
        for key in keys:
            if not self.contains(key):
                break
            held += 1
        return held

    def get(self, key: bytes, *, parent: bytes, tokens: Sequence[int], part: int = 0) -> np.ndarray | None:
        """The block's KV (rank ``part``'s share of it: a writable array over the one buffer the
        file was read into), or None when it is absent or does not match what the caller expects."""
        path = self._path(key, part)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except FileNotFoundError:
            return None
        kv = self._decode(data, key, parent, tokens, part)
        with self._lock:
            if kv is None:
                self.counters.rejected_blocks += 1
                log.warning("store block %s does not match its key; treated as a miss", key.hex()[:16])
            else:
                self.counters.loaded_blocks += 1
                self.counters.loaded_bytes += kv.nbytes
        if kv is not None:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)  # recently used: evicted last
        return kv

    @staticmethod
    def _decode(data: bytearray, key: bytes, parent: bytes, tokens: Sequence[int], part: int) -> np.ndarray | None:
        n = len(_MAGIC)
        if data[:n] != _MAGIC or len(data) < n + _HEADER_LEN.size:
            return None
        (hlen,) = _HEADER_LEN.unpack_from(data, n)
        start = n + _HEADER_LEN.size + hlen
        try:
            h = json.loads(data[n + _HEADER_LEN.size : start])
            dtype, shape = np.dtype(h["dtype"]), tuple(int(s) for s in h["shape"])
        except (ValueError, KeyError, TypeError):
            return None
        if (h.get("key") != key.hex() or h.get("parent") != parent.hex()
                or h.get("tokens") != [int(t) for t in tokens] or h.get("part", 0) != part):
            return None
        payload = memoryview(data)[start:]
        if len(payload) != dtype.itemsize * int(np.prod(shape)) or zlib.crc32(payload) != h.get("crc32"):
            return None
        return np.frombuffer(payload, dtype=dtype).reshape(shape)

    # -- pins ---------------------------------------------------------------------------------

    def pin(self, name: str, keys: Iterable[bytes], *, ttl: float) -> None:
        """Keep ``keys`` from eviction until :meth:`unpin` or ``ttl`` seconds from now."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"invalid pin name {name!r}")
        body = json.dumps({"expires": time.time() + ttl, "keys": [k.hex() for k in keys]})
        tmp = self.pins / f".{name}.tmp"
        tmp.write_text(body)
        os.rename(tmp, self.pins / name)

    def unpin(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.pins / name).unlink()

    def _pinned(self) -> set[str]:
        now, keep = time.time(), set()
        for p in self.pins.iterdir():
            if p.name.startswith("."):
                continue
            try:
                body = json.loads(p.read_text())
                expires = float(body.get("expires", 0))
                keys = [str(k) for k in body.get("keys", ())]
            except (OSError, ValueError, TypeError, AttributeError):  # being replaced, or not a pin
                continue
            if expires < now:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                continue
            keep.update(keys)
        return keep

    # -- memory -------------------------------------------------------------------------------

    def _files(self) -> dict[str, tuple[float, list[str], int]]:
        """Every block held now, whole or in part: key (hex) -> (its parts' latest mtime, their
        file names, their bytes)."""
        held: dict[str, tuple[float, list[str], int]] = {}
        for e in os.scandir(self.blocks):
            if e.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = e.stat()
                mtime, names, size = held.get(self._key_of(e.name), (0.0, [], 0))
                held[self._key_of(e.name)] = (max(mtime, st.st_mtime), [*names, e.name], size + st.st_size)
        return held

    def usage(self) -> tuple[int, int]:
        """(blocks, bytes) held now; a block counts once however many of its parts are here."""
        held = self._files()
        return len(held), sum(size for _, _, size in held.values())

    def evict(self) -> int:
        """Remove least recently used unpinned blocks (every part of each) until within capacity;
        blocks removed."""
        held = self._files()
        total = sum(size for _, _, size in held.values())
        if total <= self.capacity_bytes:
            return 0
        pinned = self._pinned()
        removed = 0
        for key, (_, names, size) in sorted(held.items(), key=lambda kv: (kv[1][0], kv[0])):
            if total <= self.capacity_bytes:
                break
            if key in pinned:
                continue
            total -= size  # gone, whoever removed it
            ours = 0
            for name in names:
                try:
                    (self.blocks / name).unlink()
                    ours += 1
                except FileNotFoundError:
                    continue  # another process evicted it first: not counted as ours
            if not ours:
                continue
            removed += 1
            with self._lock:
                self.counters.evicted_blocks += 1
                self.counters.evicted_bytes += size
        if total > self.capacity_bytes:
            log.warning("KV store over capacity (%d > %d bytes): the rest is pinned", total, self.capacity_bytes)
        return removed

    # -- counters -----------------------------------------------------------------------------

    def publish(self) -> None:
        """Write this process's counters where :meth:`counters` finds them."""
        with self._lock:
            body = json.dumps(asdict(self.counters))
        tmp = self._stats_file.with_name(f".{self._stats_file.name}.tmp")
        tmp.write_text(body)
        os.rename(tmp, self._stats_file)

    def counters_total(self) -> StoreCounters:
        """The sum of every process's published counters."""
        total = StoreCounters()
        for p in self.stats_dir.iterdir():
            if p.name.startswith("."):
                continue
            try:
                counters = StoreCounters(**json.loads(p.read_text()))
            except (OSError, ValueError, TypeError):
                continue
            if all(type(getattr(counters, f.name)) is int for f in fields(counters)):  # else: not ours, skipped whole
                total.add(counters)
        return total


def open_store(root: Path, *, capacity_bytes: int, role: str) -> tuple[KVStore, dict[str, object]]:
    """The store the instances under ``root`` wrote (once they have started), and what its blocks
    are (``describe``: block size, family, layout, dtype). Raises if they wrote none or several
    formats: instances of one host must agree on the KV layout."""
    formats = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []
    if len(formats) != 1:
        raise RuntimeError(f"the vLLM instances should share one KV format under {root}, found {formats}: "
                           "they disagree on the KV layout, dtype or block size (see their logs)")
    facts = json.loads((root / formats[0] / "config.json").read_text())
    parts = int(facts.get("parts", 1))
    return KVStore(root, fmt=formats[0], capacity_bytes=capacity_bytes, role=role, parts=parts), facts
