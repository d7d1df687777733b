"""The simulator on the Mooncake trace: its caches are the real BlockPool, so with unbounded
capacity its hit count equals the pool replay's (server.kv.trace.replay), even with requests
overlapping in time (in-flight blocks count as hits, as the pool counts them)."""

import pytest

from server.kv.pool import BlockPool
from server.kv.trace import DEFAULT_TRACE, load_trace, replay
from server.policy import OffloadPolicy
from server.sim import GPU_LLAMA8B_H100, ClusterConfig, Simulator, from_trace

pytestmark = pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason="trace not in ../shared/traces")


def hit_blocks_one_worker(n: int | None) -> tuple[int, int, float]:
    trace = load_trace(limit=n)
    capacity = len({h for t in trace for h in t.hash_ids}) + 1
    cfg = ClusterConfig(prefill_workers=0, decode_workers=1, prefill_profile=GPU_LLAMA8B_H100,
                        block_tokens=512, cache_tokens=capacity * 512,
                        policy=OffloadPolicy(threshold_tokens=None))
    res = Simulator(cfg).run(from_trace(trace))
    assert res.unfinished == 0 and res.evictions == 0
    ideal = replay(BlockPool(capacity, block_size=1), trace)
    assert res.summary.block_hit_ratio == pytest.approx(ideal.hit_ratio, abs=1e-12)
    return ideal.hit_blocks, sum(r.hit_blocks for r in res.records), res.wall_s


def test_sim_hit_count_equals_pool_replay_on_a_trace_prefix() -> None:
    ideal, sim, _ = hit_blocks_one_worker(600)
    assert sim == ideal > 0


def test_whole_trace_is_fast_and_hits_the_ideal_ratio() -> None:
    ideal, sim, wall = hit_blocks_one_worker(None)
    assert sim == ideal
    assert wall < 60.0
