"""One simulated worker's prefix cache: the real :class:`BlockPool`, one block per block id.

The simulator drives the pool with the same verbs the engine does (match, acquire, allocate,
register, commit, release) with ``block_size=1``: each block id of a :class:`SimRequest` is one
pool block standing for ``block_tokens`` tokens. Blocks registered but not committed are being
computed (or are still on the wire); a request that matches them records the request computing
them as a *dependency* and waits for its commit -- in-flight deduplication.

When the pool is full of held blocks, a request's new blocks are simply not cached (counted in
``uncached_blocks``): the simulator models compute and links, not memory admission.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from server.kv.keys import Layout
from server.kv.pool import BlockPool, PrefixMatch


@dataclass(frozen=True, slots=True)
class Holding:
    """What one request holds in one cache, and whom it waits for."""

    held: tuple[int, ...]
    """Every block id the request holds (cached hits, then its own new blocks)."""
    fresh: tuple[int, ...]
    """Its own new blocks, registered for others to match; commit them when computed."""
    deps: frozenset[int]
    """Ids of requests still computing blocks this one hit."""
    cross_module_blocks: int


class PrefixCache:
    """A :class:`BlockPool` with the producer of every in-flight block.

    >>> from server.kv.keys import Layout, Namespace
    >>> cache, lay = PrefixCache(capacity_blocks=8), Layout(Namespace.family("f"))
    >>> keys = cache.keys((1, 2, 3), lay)
    >>> h = cache.admit(7, cache.match((1, 2, 3), lay, keys), (1, 2, 3), lay, module="a")
    >>> m = cache.match((1, 2, 9), lay, cache.keys((1, 2, 9), lay)); len(m.block_ids)
    2
    >>> cache.admit(8, m, (1, 2, 9), lay, module="b").deps
    frozenset({7})
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.pool = BlockPool(capacity_blocks, block_size=1)
        self._producer: dict[int, int] = {}  # block id -> request computing it
        self.uncached_blocks = 0

    @staticmethod
    def keys(blocks: Sequence[int], layout: Layout) -> tuple[bytes, ...]:
        return tuple(layout.block_keys(blocks, block_size=1))

    def match(self, blocks: Sequence[int], layout: Layout, keys: Sequence[bytes]) -> PrefixMatch:
        return self.pool.match(blocks, layout, keys=keys)

    def admit(
        self, request_id: int, match: PrefixMatch, blocks: Sequence[int], layout: Layout, *,
        module: str, cache_new: bool = True,
    ) -> Holding:
        """Hold ``match``'s blocks and register the missing ones as computed by this request."""
        pool = self.pool
        pool.acquire(match, reader=module)
        deps = frozenset(self._producer[b] for b in match.pending)
        cross = sum(1 for b in match.block_ids if pool.block(b).computed_by != module)
        missing = match.num_blocks - len(match.block_ids)
        fresh: list[int] = []
        if cache_new and missing and pool.can_allocate(missing):
            fresh = pool.allocate(missing)
            indexed = pool.register(match, fresh, blocks, layout, computed_by=module)
            for b in fresh[:indexed]:
                self._producer[b] = request_id
        else:
            self.uncached_blocks += missing
        return Holding((*match.block_ids, *fresh), tuple(fresh), deps, cross)

    def commit(self, holding: Holding) -> None:
        """The request's new blocks are computed (or have arrived)."""
        self.pool.commit(holding.fresh)
        for b in holding.fresh:
            self._producer.pop(b, None)

    def release(self, holding: Holding) -> None:
        self.pool.release(holding.held)

    def occupancy(self) -> float:
        u = self.pool.usage()
        return u.held / u.capacity
