"""Moving a shared prefix's KV between engines: export on a prefill worker, import on a decode worker.

Everything here runs on the engine's own thread (through ``AsyncEngine.run`` and step hooks):
the pool and the KV tensors have one owner. The transport (:mod:`server.cluster.transport`)
runs on the event loop and only ever sees copies::

    prefill worker                                    decode worker
    ──────────────                                    ─────────────
                                                      Inbound.expect(): match the prefix; the
                                                        blocks it lacks are registered COMPUTING,
                                                        so requests arriving now wait on them
    Outbound.start(): add_context(prefix), pinned
    step hook: blocks newly committed ─▶ gather K,V
      ─▶ (event loop) encode ─▶ send ─── frames ───▶  Inbound.write(): copy into the blocks'
                                                        slots, commit ─▶ READY; waiters go on
    acked ─▶ unpin (the blocks stay cached, LRU)      Inbound.finish(): drop the importer's hold
                                                      Inbound.fail(): blocks not written abort;
                                                        waiting requests re-plan and prefill
                                                        the rest locally: never served unwritten

Blocks that crossed a lossy codec are imported into the family's lossy namespace:
only requests submitted with the same ``prefix_codec`` read them.

Blocks can bring the base's hidden state at the layers the decode side keeps (its layer-split
modules' splits): the prefill worker keeps it too (``--keep-hidden-layers``) and gathers it
with the K/V; the decode side then lets split requests fill from those blocks, as from blocks
it computed itself, even while they travel.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from server.cluster.codec import KVChunk
from server.cluster.messages import WorkerError
from server.engine.core import EngineCore
from server.engine.cuda import to_host
from server.engine.errors import InvalidRequest, Overloaded
from server.engine.sequence import Phase, Sequence
from server.kv.pool import BlockState, Pin


@dataclass(slots=True)
class Inbound:
    """The decode side of one transfer: blocks ``first_block ..`` of a prefix chain, expected."""

    transfer_id: str
    first_block: int
    block_ids: list[int]  # registered blocks, in chain order from first_block
    pin: Pin | None  # holds the already-cached head of the chain until the transfer ends
    prefix_codec: str | None
    hidden: bool = False  # every chunk brings the hidden state at each depth this engine keeps
    written: int = 0  # blocks written and committed, in order
    closed: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @classmethod
    def expect(
        cls, core: EngineCore, transfer_id: str, token_ids: list[int], *, salt: str, prefix_codec: str | None,
        ttl: float, hidden: bool = False,
    ) -> Inbound:
        """Register the full blocks of ``token_ids`` that this engine lacks as being computed
        elsewhere. ``ttl`` bounds how long the cached head stays pinned for the transfer.

        ``hidden``: the sender sends the hidden state at every depth this engine keeps, so the
        blocks can fill layer-split requests (exact codecs only: a lossy one's blocks land in a
        namespace no fill reads)."""
        bs = core.config.block_size
        if not token_ids or len(token_ids) % bs:
            raise InvalidRequest(f"a transferred prefix is whole blocks of {bs} tokens, got {len(token_ids)}")
        layout = core.prefix_layout(salt=salt, prefix_codec=prefix_codec)
        match = core.pool.match(token_ids, layout)
        head = list(match.block_ids)
        need = match.num_blocks - len(head)
        pin = core.pool.pin(head, ttl=ttl) if head else None  # the chain's parent must outlive the transfer
        if need and not core.pool.can_allocate(need):
            if pin is not None:
                core.pool.unpin(pin)
            raise Overloaded(f"no room for {need} transferred KV blocks", reason="kv_pool_full")
        fresh = core.pool.allocate(need, contiguous=True) if need else []
        n = core.pool.register(match, fresh, token_ids, layout, computed_by=core.base_name)
        core.pool.release(fresh[n:])  # someone else registered them meanwhile: not ours to fill
        core.scheduler.mark_imported(fresh[:n])  # their first reader counts them as imported
        hidden = hidden and bool(core.kv.hidden) and prefix_codec is None
        if hidden:  # split requests arriving meanwhile may plan to fill from them
            core.scheduler.hidden_incoming.update(fresh[:n])
        return cls(transfer_id, len(head), fresh[:n], pin, prefix_codec, hidden)

    def write(self, core: EngineCore, chunk: KVChunk) -> int:
        """Copy a chunk's K/V into its blocks and commit them; returns how many blocks it wrote.

        Chunks arrive in chain order; a chunk starting anywhere else is a protocol error."""
        if self.closed:
            raise InvalidRequest(f"transfer {self.transfer_id} is already closed")
        bs = core.config.block_size
        n = chunk.k.shape[2] // bs
        if chunk.first_block != self.first_block + self.written or chunk.k.shape[2] % bs:
            raise InvalidRequest(f"transfer {self.transfer_id}: chunk at block {chunk.first_block} "
                                 f"({chunk.k.shape[2]} tokens), expected block {self.first_block + self.written}")
        if self.written + n > self.num_blocks:
            raise InvalidRequest(f"transfer {self.transfer_id}: {self.written + n} blocks sent, "
                                 f"{self.num_blocks} expected")
        spec = core.kv.spec
        want = (spec.num_layers, spec.num_kv_heads, n * bs, spec.head_dim)
        if tuple(chunk.k.shape) != want or tuple(chunk.v.shape) != want:
            raise InvalidRequest(f"transfer {self.transfer_id}: KV shape {tuple(chunk.k.shape)}, expected {want}")
        if self.hidden:
            missing = sorted(set(core.kv.hidden) - set(chunk.hidden))
            if missing:
                raise InvalidRequest(f"transfer {self.transfer_id}: the hidden state of layers {missing} was "
                                     f"promised, the chunk carries {sorted(chunk.hidden)}")
            for depth, states in core.kv.hidden.items():
                if tuple(chunk.hidden[depth].shape) != (n * bs, states.shape[1]):
                    raise InvalidRequest(f"transfer {self.transfer_id}: hidden state {tuple(chunk.hidden[depth].shape)} "
                                         f"at layer {depth}, expected {(n * bs, states.shape[1])}")
        ids = self.block_ids[self.written : self.written + n]
        slots = core.kv.slots(ids).to(core.kv.device)
        k, v = chunk.k.to(device=core.kv.device, dtype=spec.dtype), chunk.v.to(device=core.kv.device, dtype=spec.dtype)
        for layer in range(spec.num_layers):
            core.kv.k[layer].index_copy_(1, slots, k[layer])
            core.kv.v[layer].index_copy_(1, slots, v[layer])
        if self.hidden:
            for depth, states in core.kv.hidden.items():
                states.index_copy_(0, slots, chunk.hidden[depth].to(device=states.device, dtype=states.dtype))
        core.pool.commit(ids)
        if self.hidden:
            core.scheduler.hidden_incoming.difference_update(ids)
            core.scheduler.hidden_kept.update((b, core.pool.block(b).generation) for b in ids)
        self.written += n
        return n

    @property
    def complete(self) -> bool:
        return self.written == self.num_blocks

    def finish(self, core: EngineCore) -> None:
        """The transfer ended: keep what was written, fail what was not."""
        if self.closed:
            return
        self.closed = True
        core.scheduler.hidden_incoming.difference_update(self.block_ids)
        for bid in self.block_ids[self.written :]:
            if core.pool.block(bid).state is BlockState.COMPUTING:
                core.pool.abort(bid)  # waiting requests re-plan and compute it themselves
        core.pool.release(self.block_ids)
        if self.pin is not None:
            core.pool.unpin(self.pin)

    fail = finish  # the same bookkeeping: only written blocks were committed


@dataclass(slots=True)
class Outbound:
    """The prefill side of one transfer: the base prefills (or finds) the prefix, pinned; the
    blocks ``first_block ..`` are gathered as they are committed and queued for the sender."""

    transfer_id: str
    first_block: int
    num_blocks: int  # of the whole chain
    chunk_blocks: int
    seq: Sequence
    queue: asyncio.Queue[KVChunk | BaseException | None]
    loop: asyncio.AbstractEventLoop
    hidden_depths: tuple[int, ...] = ()  # layers whose input goes with the K/V
    sent: int = 0  # next block (chain index) to gather
    done: bool = False
    computed_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def start(
        cls, core: EngineCore, transfer_id: str, token_ids: list[int], *, salt: str, first_block: int,
        chunk_blocks: int, ttl: float, loop: asyncio.AbstractEventLoop, hidden_depths: tuple[int, ...] = (),
    ) -> Outbound:
        bs = core.config.block_size
        if not token_ids or len(token_ids) % bs:
            raise InvalidRequest(f"a transferred prefix is whole blocks of {bs} tokens, got {len(token_ids)}")
        n = len(token_ids) // bs
        if not 0 <= first_block < n:
            raise InvalidRequest(f"first_block {first_block} outside the prefix's {n} blocks")
        lacking = sorted(set(hidden_depths) - set(core.kv.hidden))
        if lacking:
            raise InvalidRequest(f"this engine keeps no hidden state at layers {lacking} (it keeps "
                                 f"{sorted(core.kv.hidden) or 'none'}: start the prefill worker with --keep-hidden-layers)")
        seq = core.add_context(transfer_id, token_ids, ttl=ttl, salt=salt, exported=True)
        return cls(transfer_id, first_block, n, max(1, chunk_blocks), seq, asyncio.Queue(), loop,
                   tuple(sorted(hidden_depths)), sent=first_block)

    def on_step(self, core: EngineCore) -> None:
        """Step hook: queue the blocks committed since the last call (engine thread)."""
        if self.done:
            return
        pin = core.contexts.get(self.transfer_id)
        if pin is not None:
            ids, ready = list(pin.block_ids), self.num_blocks
        elif self.seq.phase is Phase.FINISHED:  # cancelled or failed before it was pinned
            self._put(WorkerError(f"the prefill of transfer {self.transfer_id} ended with "
                                   f"{self.seq.finish_reason.value if self.seq.finish_reason else 'no result'}"))
            self.done = True
            return
        elif self.seq.phase is Phase.WAITING:
            return
        else:
            ids, ready = self.seq.blocks, self._written(core)
        while self.sent < ready:
            n = min(self.chunk_blocks, ready - self.sent)
            self._put(gather(core, ids[self.sent : self.sent + n], self.sent, self.hidden_depths))
            self.sent += n
        if pin is not None:
            self.cached_tokens = self.seq.cached_tokens
            self.computed_tokens = self.num_blocks * core.config.block_size - self.cached_tokens
            self._put(None)  # all queued
            self.done = True

    def _written(self, core: EngineCore) -> int:
        """Leading blocks of the chain whose KV is written. Not ``num_committed_blocks``: that
        counts blocks matched while another request was still computing them (in flight)."""
        bs, n = core.config.block_size, 0
        for i, bid in enumerate(self.seq.blocks[: self.num_blocks]):
            state = core.pool.block(bid).state
            if not (state is BlockState.READY or
                    (state is BlockState.PRIVATE and (i + 1) * bs <= self.seq.num_computed)):  # computed, unshared
                break
            n += 1
        return n

    def _put(self, item: KVChunk | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def gather(core: EngineCore, block_ids: list[int], first_block: int, hidden_depths: tuple[int, ...] = ()) -> KVChunk:
    """A host copy of the K/V of ``block_ids`` (chain positions ``first_block ..``), every layer,
    and the hidden state of ``hidden_depths`` (from a device: on its way, see
    :func:`~server.engine.cuda.to_host`)."""
    first, n = block_ids[0], len(block_ids)
    slots = core.kv.slots(block_ids).to(core.kv.device)
    hidden = [core.kv.hidden[d].index_select(0, slots) for d in hidden_depths]
    if block_ids == list(range(first, first + n)):  # one strided view per layer
        views = [core.kv.block_view(layer, first, n) for layer in range(core.kv.spec.num_layers)]
        k = torch.stack([kk for kk, _ in views])
        v = torch.stack([vv for _, vv in views])
    else:
        k = torch.stack([t.index_select(1, slots) for t in core.kv.k])
        v = torch.stack([t.index_select(1, slots) for t in core.kv.v])
    (k, v, *hidden), wait = to_host(k, v, *hidden)
    return KVChunk(first_block, k, v, wait, dict(zip(hidden_depths, hidden, strict=True)))
