"""The block pool: sole owner of which KV block holds what, and of every refcount.

A request's life in the pool, in verbs::

    match = pool.match(tokens, layout)          # longest cached chain (a pure query)
    pool.acquire(match, reader="coder")         # hold its blocks; count hits and misses
    await pool.wait_ready(match.pending)        # blocks another request is still computing
    ids = pool.allocate(n)                      # free blocks first, then evict LRU; or PoolExhausted
    pool.register(match, ids, tokens, layout,   # full blocks we are about to compute: others may
                  computed_by="coder")          #   match them now and wait (in-flight dedup)
    pool.commit(ids)                            # their KV is written: wake the waiters
    pool.release(all_ids)                       # done; cached blocks become evictable (LRU)

Block states::

    FREE ──allocate──▶ PRIVATE ──register──▶ COMPUTING ──commit──▶ READY
      ▲                   │                      │ abort               │
      └──── refcount 0 ───┴──────────────────────┘ (unindexed)        └─ refcount 0 ─▶ evictable
                                                                          (LRU) ──evict──▶ FREE

Invariants (asserted by the tests): every block is exactly one of free, held (refcount > 0) or
evictable (indexed, refcount 0); a refcount is never negative; held and pinned blocks are never
evicted; a hit is served only after comparing the block's token ids, namespace and parent block,
so even a colliding digest cannot serve wrong KV.

Pins hold one reference each until unpinned or their TTL expires. The pool is not thread-safe:
one scheduler owns it (drive it from one thread or one event loop).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

import anyio

from server.kv.errors import BlockAborted, PoolExhausted, PoolInvariantError
from server.kv.keys import Digest, Layout, Namespace, sha256


class BlockState(Enum):
    FREE = "free"
    PRIVATE = "private"  # allocated, not indexed: a partial block or an unshareable one
    COMPUTING = "computing"  # indexed, KV being written; matchable, must be awaited
    READY = "ready"  # indexed, KV valid


@dataclass(slots=True, eq=False)
class Block:
    """Bookkeeping of one block. Read-only outside the pool."""

    id: int
    state: BlockState = BlockState.FREE
    ref_count: int = 0
    generation: int = 0  # bumped when the block is freed: children keyed on an old one are stale
    key: bytes | None = None
    tokens: tuple[int, ...] = ()
    namespace: Namespace | None = None
    parent: Block | None = None
    parent_generation: int = 0
    computed_by: str | None = None
    ready: anyio.Event | None = None  # created lazily by the first waiter

    def descends_from(self, parent: Block | None) -> bool:
        if parent is None:
            return self.parent is None
        return self.parent is parent and self.parent_generation == parent.generation


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix of a token sequence, as found by :meth:`BlockPool.match`."""

    keys: tuple[bytes, ...]
    """Keys of every full block of the sequence (the trailing partial block has none)."""
    block_ids: tuple[int, ...]
    """Blocks of the longest cached chain, in order; a prefix of ``keys``."""
    pending: tuple[int, ...]
    """Those of ``block_ids`` still being computed by another request (await them)."""
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def num_cached_tokens(self) -> int:
        return len(self.block_ids) * self.block_size

    @property
    def first_miss(self) -> int | None:
        """Index of the first full block not served from cache, or None if all were."""
        return None if len(self.block_ids) == len(self.keys) else len(self.block_ids)


@dataclass(slots=True)
class PoolStats:
    """Counters since the pool was created. ``*_blocks`` counts blocks, not tokens."""

    hit_blocks: int = 0
    miss_blocks: int = 0
    inflight_hit_blocks: int = 0  # hits on blocks still being computed (deduplicated prefills)
    cross_module_hit_blocks: int = 0  # hits on a block computed for another module
    evictions: int = 0
    aborted_blocks: int = 0

    @property
    def hit_ratio(self) -> float:
        total = self.hit_blocks + self.miss_blocks
        return self.hit_blocks / total if total else 0.0


@dataclass(frozen=True, slots=True)
class Pin:
    """A handle on pinned blocks. Pass it to :meth:`BlockPool.unpin`."""

    id: int
    block_ids: tuple[int, ...]
    deadline: float


@dataclass(frozen=True, slots=True)
class Usage:
    capacity: int
    free: int
    held: int
    evictable: int
    bytes_per_block: int

    @property
    def bytes_held(self) -> int:
        return self.held * self.bytes_per_block

    @property
    def bytes_cached(self) -> int:
        return self.evictable * self.bytes_per_block


class BlockPool:
    """Paged KV blocks with chained prefix keys, refcounts, LRU eviction, pins and in-flight waits.

    ``digest`` and ``clock`` are injectable for tests (a weak digest to force collisions, a fake
    clock for TTLs). ``bytes_per_block`` only feeds :meth:`usage`.

    >>> from server.kv.keys import Layout, Namespace
    >>> pool = BlockPool(num_blocks=8, block_size=4)
    >>> layout = Layout(Namespace.family("f" * 64))
    >>> tokens = list(range(10))                      # two full blocks and a partial one
    >>> m = pool.match(tokens, layout); pool.acquire(m, reader="planner")
    >>> ids = pool.allocate(3)
    >>> pool.register(m, ids, tokens, layout, computed_by="planner")
    2
    >>> pool.commit(ids); pool.release(ids)
    >>> m2 = pool.match(tokens, layout); m2.num_cached_tokens
    8
    >>> pool.acquire(m2, reader="coder"); pool.stats.cross_module_hit_blocks
    2
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        bytes_per_block: int = 0,
        digest: Digest = sha256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.digest = digest
        self.clock = clock
        self.stats = PoolStats()
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks))  # a stack: low ids are reused first
        self._free.reverse()
        self._index: dict[bytes, Block] = {}  # key -> the one indexed block with that key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._pins: dict[int, Pin] = {}
        self._pin_deadlines: list[tuple[float, int]] = []  # heap of (deadline, pin id)
        self._pin_ids = itertools.count(1)

    # ---- queries -------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return len(self._blocks)

    def block(self, block_id: int) -> Block:
        return self._blocks[block_id]

    def usage(self) -> Usage:
        free, evictable = len(self._free), len(self._evictable)
        return Usage(
            self.capacity, free, self.capacity - free - evictable, evictable, self.bytes_per_block
        )

    def indexed(self) -> Iterator[Block]:
        """Every block a request can currently match (READY or COMPUTING)."""
        return iter(list(self._index.values()))

    def prefix_tokens(self, block: Block) -> tuple[int, ...]:
        """All token ids from the start of the sequence through ``block`` (walks the parents)."""
        parts: list[tuple[int, ...]] = []
        b: Block | None = block
        while b is not None:
            parts.append(b.tokens)
            b = b.parent
        return tuple(t for part in reversed(parts) for t in part)

    def keys(self, tokens: Sequence[int], layout: Layout) -> list[bytes]:
        return layout.block_keys(tokens, block_size=self.block_size, digest=self.digest)

    def match(
        self, tokens: Sequence[int], layout: Layout, *, keys: Sequence[bytes] | None = None
    ) -> PrefixMatch:
        """The longest chain of cached blocks for ``tokens`` in ``layout``'s namespaces.

        Pure: changes no state. Pass precomputed ``keys`` to skip hashing.
        """
        keys = tuple(self.keys(tokens, layout) if keys is None else keys)
        found: list[int] = []
        pending: list[int] = []
        parent: Block | None = None
        bs = self.block_size
        for i, key in enumerate(keys):
            b = self._index.get(key)
            if b is None or not self._same_block(
                b, tokens[i * bs : (i + 1) * bs], layout.namespace_of(i, block_size=bs), parent
            ):
                break
            found.append(b.id)
            if b.state is BlockState.COMPUTING:
                pending.append(b.id)
            parent = b
        return PrefixMatch(keys, tuple(found), tuple(pending), bs)

    @staticmethod
    def _same_block(b: Block, tokens: Sequence[int], ns: Namespace, parent: Block | None) -> bool:
        # The collision guard: a key match alone is never trusted.
        return b.namespace == ns and b.tokens == tuple(tokens) and b.descends_from(parent)

    # ---- holding and releasing -----------------------------------------------------------------

    def acquire(self, match: PrefixMatch, *, reader: str) -> None:
        """Hold ``match``'s blocks for a request of module ``reader``; count its hits and misses."""
        for bid in match.block_ids:
            b = self._blocks[bid]
            if b.state not in (BlockState.READY, BlockState.COMPUTING):
                raise PoolInvariantError(f"block {bid} is {b.state.value}; match is stale")
            self._hold(b)
            if b.computed_by != reader:
                self.stats.cross_module_hit_blocks += 1
        self.stats.hit_blocks += len(match.block_ids)
        self.stats.inflight_hit_blocks += len(match.pending)
        self.stats.miss_blocks += match.num_blocks - len(match.block_ids)

    def _hold(self, b: Block) -> None:
        if b.ref_count == 0 and b.state is BlockState.READY:
            del self._evictable[b.id]
        b.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block.

        Blocks are released in *reverse* order, so a chain's tail becomes least recently used
        before its head: eviction then trims chains from the end and never strands a child
        whose parent is gone.
        """
        for bid in reversed(list(block_ids)):
            self._unhold(self._blocks[bid])

    def _unhold(self, b: Block) -> None:
        if b.ref_count <= 0:
            raise PoolInvariantError(f"block {b.id} released more often than held")
        b.ref_count -= 1
        if b.ref_count:
            return
        if b.state is BlockState.READY:
            self._evictable[b.id] = None  # most recently used
        else:  # PRIVATE, or COMPUTING abandoned by every holder
            if b.state is BlockState.COMPUTING:
                self._abort(b)
            self._free_block(b)

    # ---- allocation ----------------------------------------------------------------------------

    def can_allocate(self, n: int, *, keeping: Iterable[int] = ()) -> bool:
        """Whether ``n`` blocks can be allocated now; with ``keeping``, once those blocks are held
        too (a match about to be acquired: its evictable blocks are no longer room)."""
        self.expire_pins()
        kept = sum(1 for b in set(keeping) if b in self._evictable)
        return n <= len(self._free) + len(self._evictable) - kept

    def allocate(self, n: int, *, contiguous: bool = False) -> list[int]:
        """``n`` private blocks, each held once. Evicts least recently used blocks if needed.

        With ``contiguous``, prefers a run of consecutive ids among the free blocks (so the
        engine can read them as one view), falling back to the lowest free ids: contiguity is
        best effort, never a reason to fail or to evict more. Raises :class:`PoolExhausted`
        (with nothing changed) if fewer than ``n`` blocks are free or evictable.
        """
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if not self.can_allocate(n):
            raise PoolExhausted(n, len(self._free) + len(self._evictable), self.capacity)
        while len(self._free) < n:
            bid, _ = self._evictable.popitem(last=False)
            self._free_block(self._blocks[bid])
            self.stats.evictions += 1
        if contiguous and n > 1:
            ids = _take_run(self._free, n)
        else:
            ids = [self._free.pop() for _ in range(n)]
        for bid in ids:
            b = self._blocks[bid]
            b.state, b.ref_count = BlockState.PRIVATE, 1
        return ids

    def _free_block(self, b: Block) -> None:
        assert b.ref_count == 0, f"freeing held block {b.id}"
        if b.key is not None and self._index.get(b.key) is b:
            del self._index[b.key]
        b.state, b.key, b.tokens, b.namespace = BlockState.FREE, None, (), None
        b.parent, b.computed_by, b.ready = None, None, None
        b.generation += 1
        self._free.append(b.id)

    # ---- computing -----------------------------------------------------------------------------

    def register(
        self,
        match: PrefixMatch,
        block_ids: Sequence[int],
        tokens: Sequence[int],
        layout: Layout,
        *,
        computed_by: str,
    ) -> int:
        """Index held private blocks as the next full blocks of ``tokens`` after ``match``.

        ``block_ids[j]`` becomes full block ``match.first_miss + j``, chained to the block before
        it. Other requests can match these blocks from now on and wait for :meth:`commit`.
        Indexing stops at the first key that a live block already owns (a duplicate computed
        concurrently, or a digest collision): the rest stay private — correct, just not shared.
        Returns how many blocks were indexed. Extra ids (a trailing partial block) stay private.
        """
        first = len(match.block_ids)
        parent = self._blocks[match.block_ids[-1]] if first else None
        bs = self.block_size
        for j, bid in enumerate(block_ids[: match.num_blocks - first]):
            i = first + j
            b = self._blocks[bid]
            if b.state is not BlockState.PRIVATE or b.ref_count < 1:
                raise PoolInvariantError(f"register needs held private blocks; {bid} is {b.state.value}")
            if not self._claim(match.keys[i]):
                return j
            b.state, b.key, b.tokens = BlockState.COMPUTING, match.keys[i], tuple(tokens[i * bs : (i + 1) * bs])
            b.namespace = layout.namespace_of(i, block_size=bs)
            b.parent, b.parent_generation = parent, (0 if parent is None else parent.generation)
            b.computed_by = computed_by
            self._index[b.key] = b
            parent = b
        return min(len(block_ids), match.num_blocks - first)

    def _claim(self, key: bytes) -> bool:
        """Make ``key`` available for a new block unless a live block owns it."""
        holder = self._index.get(key)
        if holder is None:
            return True
        if holder.parent is None or holder.descends_from(holder.parent):
            return False
        # A stale child of a freed parent is unreachable: replace it. It keeps its KV for
        # whoever still holds it, as a private block.
        del self._index[key]
        holder.key = None
        if holder.ref_count == 0:
            del self._evictable[holder.id]
            self._free_block(holder)
        else:
            holder.state = BlockState.PRIVATE
        return True

    def commit(self, block_ids: Iterable[int]) -> None:
        """The blocks' KV is written: they become READY and their waiters wake.

        Private blocks (not indexed by :meth:`register`) are skipped.
        """
        for bid in block_ids:
            b = self._blocks[bid]
            if b.state is BlockState.PRIVATE:
                continue
            if b.state is not BlockState.COMPUTING:
                raise PoolInvariantError(f"commit of block {bid} in state {b.state.value}")
            b.state = BlockState.READY
            if b.ready is not None:
                b.ready.set()

    def abort(self, block_id: int) -> None:
        """The producer gives up computing the block: unindex it and wake waiters with an error.

        The block stays held by everyone who held it; it is freed at its last release.
        """
        b = self._blocks[block_id]
        if b.state is not BlockState.COMPUTING:
            raise PoolInvariantError(f"abort of block {block_id} in state {b.state.value}")
        self._abort(b)

    def _abort(self, b: Block) -> None:
        if self._index.get(b.key) is b:  # type: ignore[arg-type]
            del self._index[b.key]  # type: ignore[arg-type]
        b.state, b.key = BlockState.PRIVATE, None
        self.stats.aborted_blocks += 1
        if b.ready is not None:
            b.ready.set()

    async def wait_ready(self, block_ids: Iterable[int]) -> None:
        """Wait until each block is READY. Raises :class:`BlockAborted` if one is abandoned."""
        for bid in block_ids:
            b = self._blocks[bid]
            generation = b.generation
            if b.state is BlockState.COMPUTING:
                if b.ready is None:
                    b.ready = anyio.Event()
                await b.ready.wait()
            if b.state is not BlockState.READY or b.generation != generation:
                raise BlockAborted(f"block {bid} was abandoned by the request computing it")

    # ---- pins ----------------------------------------------------------------------------------

    def pin(self, block_ids: Sequence[int], *, ttl: float) -> Pin:
        """Hold ``block_ids`` (a cached prefix) until :meth:`unpin` or ``ttl`` seconds pass."""
        if ttl <= 0:
            raise ValueError("pin ttl must be positive")
        for bid in block_ids:
            if self._blocks[bid].state not in (BlockState.READY, BlockState.COMPUTING):
                raise PoolInvariantError(f"only cached blocks can be pinned; {bid} is not")
        for bid in block_ids:
            self._hold(self._blocks[bid])
        pin = Pin(next(self._pin_ids), tuple(block_ids), self.clock() + ttl)
        self._pins[pin.id] = pin
        heapq.heappush(self._pin_deadlines, (pin.deadline, pin.id))
        return pin

    def unpin(self, pin: Pin) -> bool:
        """Release a pin early. Returns False if it had already expired or been released."""
        if self._pins.pop(pin.id, None) is None:
            return False
        self.release(pin.block_ids)
        return True

    def expire_pins(self) -> int:
        """Release every pin whose deadline has passed; returns how many."""
        now, expired = self.clock(), 0
        while self._pin_deadlines and self._pin_deadlines[0][0] <= now:
            _, pin_id = heapq.heappop(self._pin_deadlines)
            pin = self._pins.pop(pin_id, None)
            if pin is not None:
                self.release(pin.block_ids)
                expired += 1
        return expired

    def pinned_blocks(self) -> set[int]:
        """Blocks held by live pins (they cannot be freed before their pins end)."""
        return {b for pin in self._pins.values() for b in pin.block_ids}

    def next_pin_deadline(self) -> float | None:
        """The earliest deadline among live pins (pool clock), or None without pins."""
        return min((p.deadline for p in self._pins.values()), default=None)

    def is_pinned(self, pin: Pin) -> bool:
        """True while ``pin`` holds its blocks (not unpinned, not expired)."""
        return pin.id in self._pins

    @property
    def pins(self) -> list[Pin]:
        return list(self._pins.values())


def _take_run(free: list[int], n: int) -> list[int]:
    """Remove and return ``n`` ids from ``free``: the lowest run of consecutive ids if one
    exists, else the ``n`` lowest. ``free`` stays a stack of the rest (highest first)."""
    ordered = sorted(free)
    start = 0
    for i in range(1, len(ordered) + 1):
        if i - start == n:
            break
        if i < len(ordered) and ordered[i] != ordered[i - 1] + 1:
            start = i
    ids = ordered[start : start + n] if i - start == n else ordered[:n]
    taken = set(ids)
    free[:] = [b for b in reversed(ordered) if b not in taken]
    return ids
