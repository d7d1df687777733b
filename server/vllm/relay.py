"""Prefix KV between hosts: the frontend pushes the base's store blocks into another host's store.

The base instance saves a prefix into its host's store (:mod:`server.vllm.store`, shared memory).
An agent served by a node on another host (:mod:`server.vllm.node`) loads from *that* host's
store, so before the request goes there the frontend sends the blocks the node lacks, over the
cluster's KV transport (:mod:`server.cluster.transport`: TCP, every frame under the cluster
secret's HMAC)::

    frontend                                               node (another host)
    POST /internal/vllm/lookup {keys} ───────────────────▶ how many leading blocks it holds
    push_blocks(blocks it lacks) ── open {meta: format, pin, ttl, keys} ──▶ StoreReceiver.on_open:
                                                             same KV format? pin every key
                                 ── one kv frame per block ──▶ on_frame: check header and crc32,
                                    (and tensor-parallel rank)                                  put
                                    header {block: key, parent, tokens, part, dtype, shape, crc32}
                                 ── end ─────────────────────▶ on_end: evict to capacity; ack
    POST /internal/vllm/completions (the request's pin) ─▶ the agent's instance loads them

A block's bytes are the vLLM paged layout of the sending host, as they are: the transfer is
lossless (the codec is the KV dtype's raw one), and a node whose store has another format (another
attention backend, dtype, block size or family) refuses the transfer at ``open``. The pin keeps the
blocks from eviction until the request ends (the node unpins it) or its TTL passes.

>>> transfer_codec("torch.bfloat16"), transfer_codec("torch.float32")
('bf16', 'fp32')
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from server.cluster.codec import Frame
from server.cluster.errors import ProtocolError
from server.cluster.transport import open_sender
from server.vllm.store import KVStore, StoreBlock

log = logging.getLogger("agentshare.vllm.relay")

_RAW_CODECS = {"torch.float32": "fp32", "torch.bfloat16": "bf16"}


def transfer_codec(kv_dtype: str) -> str:
    """The lossless codec whose name a transfer of KV in ``kv_dtype`` (``str(torch.dtype)``) carries."""
    try:
        return _RAW_CODECS[kv_dtype]
    except KeyError:
        raise ValueError(f"no lossless transfer codec for KV of dtype {kv_dtype}: the vllm engine moves "
                         f"prefix KV between hosts in {', '.join(_RAW_CODECS)} only") from None


@dataclass(frozen=True, slots=True)
class Pushed:
    """What one push moved."""

    blocks: int
    bytes: int
    seconds: float


async def push_blocks(store: KVStore, blocks: Sequence[StoreBlock], tokens: Sequence[int], *, address: str,
                      key: bytes, fmt: str, codec: str, pin: str, ttl: float, transfer_id: str,
                      keys: Sequence[bytes] = (), timeout: float = 30.0) -> Pushed:
    """Send ``blocks`` (of the prefix ``tokens``) from ``store`` to the node's receiver at ``address``
    (``tcp://host:port``); returns once the node has written them all. The node pins ``keys``
    (default: the blocks') under ``pin`` for ``ttl`` seconds. Raises a transfer error
    (:mod:`server.cluster.errors`) if the node refuses or the link breaks, ``LookupError`` if a
    block is no longer in ``store``."""
    started = time.monotonic()
    pinned = [k.hex() for k in (keys or [b.key for b in blocks])]
    sender = await open_sender(address, transfer_id, codec=codec, key=key, timeout=timeout,
                               meta={"fmt": fmt, "pin": pin, "ttl": ttl, "keys": pinned})
    sent = 0
    try:
        for b in blocks:
            block_tokens = [int(t) for t in tokens[b.start:b.end]]
            for part in range(store.parts):  # one frame per tensor-parallel rank's share
                raw = await asyncio.to_thread(store.get, b.key, parent=b.parent, tokens=block_tokens, part=part)
                if raw is None:
                    raise LookupError(f"store block {b.key.hex()[:16]} left the store before it was sent")
                payload = raw.data.cast("B")  # the buffer the block was read into, as bytes: no copy
                header = {"kind": "kv", "codec": codec, "block": {
                    "key": b.key.hex(), "parent": b.parent.hex(), "tokens": block_tokens,
                    "part": part, "dtype": raw.dtype.str, "shape": list(raw.shape), "crc32": zlib.crc32(payload)}}
                await sender.send(Frame(header, payload))
                sent += payload.nbytes
        await sender.finish()
    except BaseException as exc:
        await sender.abort(f"{type(exc).__name__}: {exc}")
        raise
    return Pushed(len(blocks), sent, time.monotonic() - started)


class StoreReceiver:
    """The node's :class:`~server.cluster.transport.ReceiveHandler`: writes pushed blocks into its
    store. ``fmt`` is the store's format: a transfer of any other is refused."""

    def __init__(self, store: KVStore, fmt: str) -> None:
        self.store, self.fmt = store, fmt
        self.received_blocks = 0
        self.received_bytes = 0
        self.failed_transfers = 0

    async def on_open(self, transfer_id: str, header: dict[str, Any]) -> None:
        meta = header.get("meta") or {}
        if meta.get("fmt") != self.fmt:
            raise ProtocolError(f"KV of format {meta.get('fmt')!r} offered to a store of format {self.fmt!r}: the "
                                "hosts' vLLM instances lay KV out differently (attention backend, dtype, block "
                                "size or family); run the same vLLM build and options on every host")
        pin, ttl, keys = meta.get("pin"), meta.get("ttl"), meta.get("keys")
        if not isinstance(pin, str) or not isinstance(ttl, int | float) or not isinstance(keys, list):
            raise ProtocolError(f"open meta needs pin (str), ttl (number) and keys (list), got {meta!r}")
        try:
            self.store.pin(pin, [bytes.fromhex(k) for k in keys], ttl=float(ttl))
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"bad pin in open meta: {exc}") from None

    async def on_frame(self, transfer_id: str, frame: Frame) -> None:
        b: Any = frame.header.get("block")
        try:
            key, parent = bytes.fromhex(b["key"]), bytes.fromhex(b["parent"])
            tokens = [int(t) for t in b["tokens"]]
            dtype, shape = np.dtype(b["dtype"]), tuple(int(s) for s in b["shape"])
            crc, part = int(b["crc32"]), int(b.get("part", 0))
        except (TypeError, KeyError, ValueError):
            raise ProtocolError("a store block frame needs block {key, parent, tokens, part, dtype, shape, crc32}, "
                                f"got {b!r}") from None
        if not 0 <= part < self.store.parts:
            raise ProtocolError(f"store block {key.hex()[:16]}: part {part} of a store of {self.store.parts} part(s)")
        payload = frame.payload
        if zlib.crc32(payload) != crc or len(payload) != dtype.itemsize * int(np.prod(shape)):
            raise ProtocolError(f"store block {key.hex()[:16]} arrived damaged (length or crc32)")
        kv = np.frombuffer(payload, dtype=dtype).reshape(shape)
        await asyncio.to_thread(self.store.put, key, parent=parent, tokens=tokens, kv=kv, part=part)
        self.received_blocks += 1
        self.received_bytes += len(payload)

    async def on_end(self, transfer_id: str, error: str | None) -> None:
        if error is not None:
            self.failed_transfers += 1
            log.warning("KV push failed", extra={"event": "vllm_push_failed", "transfer": transfer_id, "error": error})
        await asyncio.to_thread(self.store.evict)
        self.store.publish()
