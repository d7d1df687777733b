"""The scheduler: which requests run, which of their positions each step computes, and their KV.

It owns the queues and the KV reservations; it never runs the model::

    waiting (FIFO) ──admit──▶ running ──schedule──▶ work items (request, first position, count)
       │                        │
       │  admission reserves prompt + max_tokens blocks at once: the request's cached chain
       │  (shared blocks of the family, the module's own) plus fresh blocks it registers as
       │  computing, so later arrivals with the same prefix wait for them (one prefill)
       │
       └── re-plan: a block it waited for was abandoned; start over from a fresh match

Per step: one token for every decoding request first, then prefill chunks in arrival order
within ``max_step_tokens`` (chunked prefill; ``max_prefill_step_tokens`` when nothing decodes,
and then a prompt's rest of at most ``prefill_tail_tokens`` past it joins the step).
A module whose rows run in their own forward (a full fine-tune) has its chunk cut at the
invocation point, so base rows and module rows never share a chunk. No request is preempted: admission reserves all it will need.

A layer-split module (``recompute_layers``) keeps its prefix blocks in its own namespace. Those
it misses are *filled* where the family's cache holds the same blocks, computed here (so their
hidden state at the split is kept): admission holds those family blocks (waiting for them if
this engine is still computing them), and the runner copies their lower layers' K/V and
recomputes only the top layers from their hidden state (those rows join the step's forward at
the split; the rest of the chunk runs from layer 0 in the same forward).
Prefix blocks the family's cache lacks, the module computes itself, base weights below the
split, its own above: the same KV, at the price of the lower layers.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from server.engine.config import EngineConfig, EngineStats
from server.engine.kinds import kind_of
from server.engine.sequence import Phase, Sequence
from server.kv.keys import Layout, NamespaceKind
from server.kv.pool import BlockPool, BlockState, PrefixMatch
from server.kv.storage import KVStorage
from server.prompt import Prompt

T = TypeVar("T")
WorkItem = tuple[Sequence, int, int]
"""A request, its first position in this step, how many positions."""


class Scheduler:
    """Admission, step budgets and chunking over one :class:`BlockPool`."""

    def __init__(self, pool: BlockPool, kv: KVStorage, config: EngineConfig, stats: EngineStats) -> None:
        self.pool, self.kv, self.config, self.stats = pool, kv, config, stats
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.imported: dict[int, int] = {}  # block -> its generation when imported, until first read
        self.hidden_kept: dict[int, int] = {}  # family block -> generation whose hidden state this engine wrote
        self.computing_here: set[int] = set()  # blocks a request here registered and has not written yet
        self.hidden_incoming: set[int] = set()  # blocks on their way over a link with their hidden state

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def refuse_if_pins_block(self, prompt: Prompt, layout: Layout, capacity: int) -> float | None:
        """Seconds until the first pin ends, if ``prompt`` could only be admitted once pinned
        contexts expire (the caller refuses it now rather than queue it that long); else None."""
        pinned = self.pool.pinned_blocks()
        if not pinned:
            return None
        usable = set(self.pool.match(list(prompt.token_ids), layout).block_ids)
        need = math.ceil(capacity / self.config.block_size) - len(usable)
        if need <= self.pool.capacity - len(pinned - usable):
            return None
        deadline = self.pool.next_pin_deadline()
        return max(0.0, (deadline or 0.0) - self.pool.clock())

    # ---- admission -------------------------------------------------------------------------

    def admit(self, fail: Callable[[Sequence, Exception], T]) -> list[T]:
        """Move waiting requests to running, FIFO, while their KV fits. A request that raises
        while being admitted goes to ``fail`` (which must end it) and admission goes on."""
        failed: list[T] = []
        while self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            try:
                if not self.reserve(seq):
                    break  # FIFO: wait for memory to free up
            except Exception as exc:
                failed.append(fail(seq, exc))
                continue
            self.waiting.popleft()
            self.running.append(seq)
        return failed

    def reserve(self, seq: Sequence) -> bool:
        """Reserve ``seq``'s blocks (its cached chain plus fresh ones); False if they do not fit."""
        prompt, bs = list(seq.prompt.token_ids), self.config.block_size
        match = self.pool.match(prompt, seq.layout)
        if match.num_cached_tokens >= len(prompt) and seq.pin_ttl is None:  # sample from a computed row
            ids = match.block_ids[:-1]
            match = PrefixMatch(match.keys, ids, tuple(b for b in match.pending if b in ids), bs)
        need = math.ceil(seq.capacity / bs) - len(match.block_ids)
        if not self.pool.can_allocate(need, keeping=match.block_ids):  # its own cached blocks are not room
            return False
        self.pool.acquire(match, reader=seq.module.name)
        fresh = self.pool.allocate(need, contiguous=True)
        self.pool.register(match, fresh, prompt, seq.layout, computed_by=seq.module.name)
        self.computing_here.update(b for b in fresh if self.pool.block(b).state is BlockState.COMPUTING)
        seq.blocks = [*match.block_ids, *fresh]
        seq.slot_table = self.kv.slots(seq.blocks)[: seq.capacity]
        limit, run = min(seq.prompt.context_len // bs, len(seq.blocks)), 0
        while run < limit and (run == 0 or seq.blocks[run] == seq.blocks[run - 1] + 1):
            run += 1
        seq.prefix_blocks = run
        seq.match, seq.pending = match, match.pending
        seq.num_computed = seq.cached_tokens = match.num_cached_tokens
        seq.num_committed_blocks = len(match.block_ids)
        seq.phase, seq.admitted_at = Phase.PREFILL, time.monotonic()
        self._count_cached(seq, +1)
        if seq.split_layer is not None:
            self._plan_fill(seq, prompt)
        return True

    def _plan_fill(self, seq: Sequence, prompt: list[int]) -> None:
        """Hold the family's blocks that can fill ``seq``'s missed prefix blocks: from its first
        miss, the run of family blocks this engine computed (their hidden state kept), ready or
        still being computed here (then ``seq`` waits for them)."""
        bs = self.config.block_size
        first = seq.num_computed // bs
        if seq.split_layer not in self.kv.hidden:
            return
        fam, usable = self.fillable(prompt, seq.layout, first, seq.invocation_point)
        if usable == first:
            return
        ids = fam.block_ids[first:usable]
        pending = tuple(b for b in fam.pending if b in ids)
        self.pool.acquire(PrefixMatch(fam.keys[first:usable], ids, pending, bs), reader=seq.module.name)
        seq.fill_blocks, seq.fill_start, seq.fill_end = list(ids), first * bs, usable * bs
        seq.pending = (*seq.pending, *pending)

    def fillable(self, tokens: list[int], layout: Layout, first: int, ip: int) -> tuple[PrefixMatch, int]:
        """The family's match of the full blocks before ``ip``, and the end of the run of them,
        from block ``first`` on, that can fill a split module's prefix (:meth:`has_hidden`)."""
        bs = self.config.block_size
        fam = self.pool.match(tokens[: ip // bs * bs], Layout(layout.family))
        end = first
        while end < len(fam.block_ids) and self.has_hidden(fam.block_ids[end]):
            end += 1
        return fam, end

    def has_hidden(self, block_id: int) -> bool:
        """Whether a family block's hidden state was written here (computed here, or imported
        with it), or will be (this engine is computing it, or it is on its way with it)."""
        b = self.pool.block(block_id)
        if b.state is BlockState.COMPUTING:
            return block_id in self.computing_here or block_id in self.hidden_incoming
        return b.state is BlockState.READY and self.hidden_kept.get(block_id) == b.generation

    def fill_done(self, seq: Sequence) -> None:
        """``seq`` is past its fill: let go of the family blocks it read."""
        if seq.fill_blocks:
            self.pool.release(seq.fill_blocks)
            seq.fill_blocks = []

    def mark_imported(self, block_ids: list[int]) -> None:
        """These blocks arrive over a link: the first request served here that reads one counts
        it as imported (``EngineStats.imported_prompt_tokens``), later ones as reused."""
        for bid in block_ids:
            self.imported[bid] = self.pool.block(bid).generation

    def _count_cached(self, seq: Sequence, sign: int) -> None:
        """Count (``+1``, at admission) or uncount (``-1``, at a re-plan) ``seq``'s cached tokens,
        under its role; a served request takes the import marks of the blocks it reads."""
        if seq.exported:
            self.stats.exported_cached_tokens += sign * seq.cached_tokens
            return
        self.stats.cached_prompt_tokens += sign * seq.cached_tokens
        if sign < 0:
            self.imported.update(seq.imported)  # the next reader counts them
            self.stats.imported_prompt_tokens -= len(seq.imported) * self.config.block_size
            seq.imported = []
            return
        assert seq.match is not None
        for bid in seq.match.block_ids:
            generation = self.imported.pop(bid, None)
            if generation is not None and generation == self.pool.block(bid).generation:
                seq.imported.append((bid, generation))
        self.stats.imported_prompt_tokens += len(seq.imported) * self.config.block_size

    def resolve_pending(self) -> None:
        """Requests whose awaited blocks are all ready may run; those whose producer gave up
        re-plan."""
        for seq in [s for s in self.running if s.pending]:
            states = {self.pool.block(b).state for b in seq.pending}
            if states <= {BlockState.READY}:
                seq.pending = ()
            elif not states <= {BlockState.READY, BlockState.COMPUTING}:
                self.replan(seq)  # its producer gave up: start over from a fresh match

    def replan(self, seq: Sequence) -> None:
        self.drop_blocks(seq)
        self.running.remove(seq)
        self._count_cached(seq, -1)
        seq.phase, seq.pending, seq.num_computed, seq.cached_tokens = Phase.WAITING, (), 0, 0
        self.waiting.appendleft(seq)
        self.stats.replans += 1

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> list[WorkItem]:
        """This step's work: one token per decoding request, then prefill chunks in budget."""
        work: list[WorkItem] = []
        budget = self.config.max_step_tokens
        for seq in self.running:
            if seq.phase is Phase.DECODE:
                work.append((seq, len(seq.tokens) - 1, 1))
                budget -= 1
        tail = 0
        if not work:  # nothing decodes: a bigger chunk stalls nobody, nor does a short tail
            budget = max(budget, self.config.max_prefill_step_tokens)
            tail = self.config.prefill_tail_tokens
        for seq in self.running:
            if seq.phase is not Phase.PREFILL or seq.pending or budget <= 0:
                continue
            start = seq.num_computed
            rest = seq.prompt_len - start
            n = rest if rest <= budget + tail else budget
            if kind_of(seq.module.kind).own_forward and start < seq.invocation_point:
                n = min(n, seq.invocation_point - start)  # base rows and module rows run apart
            work.append((seq, start, n))
            budget -= n
        return work

    def computed(self, seq: Sequence, upto: int) -> None:
        """Positions before ``upto`` are written: hand its full blocks to the pool as ready."""
        seq.num_computed = upto
        full = min(upto // self.config.block_size, len(seq.blocks))
        if full > seq.num_committed_blocks:
            done = seq.blocks[seq.num_committed_blocks : full]
            self.pool.commit(done)
            self.computing_here.difference_update(done)
            seq.num_committed_blocks = full
            if self.kv.hidden:
                for bid in done:  # computed here: their hidden state at every split depth is written
                    b = self.pool.block(bid)
                    if b.namespace is not None and b.namespace.kind is NamespaceKind.FAMILY:
                        self.hidden_kept[bid] = b.generation
        if upto >= seq.fill_end:
            self.fill_done(seq)

    # ---- the end ---------------------------------------------------------------------------

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of its queue and free its KV (blocks it never computed are aborted,
        so whoever waits for them computes them)."""
        if seq.phase is Phase.WAITING:
            if seq.blocks:  # it failed half-way through admission
                self.drop_blocks(seq)
            self.waiting.remove(seq)
        elif seq.phase is not Phase.FINISHED:
            self.drop_blocks(seq)
            self.running.remove(seq)

    def forget(self, seq: Sequence) -> None:
        """Drop ``seq`` from the queues without touching the pool (its books are broken)."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)

    def drop_blocks(self, seq: Sequence) -> None:
        self.fill_done(seq)
        seq.fill_start = seq.fill_end = 0
        self.computing_here.difference_update(seq.blocks)
        own = len(seq.match.block_ids) if seq.match else 0
        for bid in seq.blocks[max(own, seq.num_committed_blocks) :]:
            if self.pool.block(bid).state is BlockState.COMPUTING:
                self.pool.abort(bid)  # never computed: whoever waits for it must compute it
        self.pool.release(seq.blocks)
        seq.blocks, seq.match = [], None
