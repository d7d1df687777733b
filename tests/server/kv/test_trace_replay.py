"""The Mooncake trace through the pool, without a model: hit ratios vs. obvious references."""

from collections import OrderedDict

import pytest

from server.kv.pool import BlockPool
from server.kv.trace import DEFAULT_TRACE, load_trace, replay

pytestmark = pytest.mark.skipif(
    not DEFAULT_TRACE.exists(), reason=f"trace not at {DEFAULT_TRACE} (ships in ../shared/traces)"
)


@pytest.fixture(scope="module")
def trace():
    return load_trace()


def ideal_hits(trace) -> tuple[int, int]:
    """Unbounded cache: a block hits iff its whole prefix was seen before."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for req in trace:
        prefixes = [req.hash_ids[: i + 1] for i in range(len(req.hash_ids))]
        n = 0
        while n < len(prefixes) and prefixes[n] in seen:
            n += 1
        hits += n
        total += len(prefixes)
        seen.update(prefixes)
    return hits, total


def lru_hits(trace, capacity: int) -> int:
    """A block-level LRU over whole prefixes. A request holds its hit blocks while it allocates,
    then touches its blocks tail-first, so the head of the chain ends most recently used."""
    lru: OrderedDict[tuple[int, ...], None] = OrderedDict()
    hits = 0
    for req in trace:
        prefixes = [req.hash_ids[: i + 1] for i in range(len(req.hash_ids))]
        n = 0
        while n < len(prefixes) and prefixes[n] in lru:
            n += 1
        hits += n
        for p in prefixes[:n]:
            del lru[p]  # held: not evictable during this request
        while len(lru) + len(prefixes) > capacity:
            lru.popitem(last=False)
        for p in reversed(prefixes):
            lru.pop(p, None)
            lru[p] = None
    return hits


def test_unbounded_capacity_gives_exactly_the_ideal_hit_ratio(trace):
    hits, total = ideal_hits(trace)
    assert round(hits / total, 3) == 0.366  # the trace README's figure
    result = replay(BlockPool(total, 1), trace)
    assert (result.hit_blocks, result.total_blocks, result.evictions) == (hits, total, 0)


@pytest.mark.parametrize("capacity", [1_000, 4_000, 16_000, 64_000])
def test_bounded_lru_matches_the_reference_simulator(trace, capacity):
    result = replay(BlockPool(capacity, 1), trace)
    assert result.skipped_requests == 0
    assert result.evictions > 0
    assert result.hit_blocks == lru_hits(trace, capacity)


def test_malformed_trace_line_names_the_line(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n{"x": 1}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        load_trace(bad)
