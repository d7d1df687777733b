import pytest

from server.kv.trace import TraceRequest
from server.sim import (
    CPU_SMOLLM2_135M,
    GPU_LLAMA8B_H100,
    MultiAgentWorkload,
    from_trace,
    kv_bytes_per_token,
)


def test_profiles_match_the_stated_figures() -> None:
    assert CPU_SMOLLM2_135M.kv_bytes(2048) == 45 * 2**20  # docs/design.md §5: 45 MiB per 2,048 tokens
    assert CPU_SMOLLM2_135M.prefill_seconds(2048) == pytest.approx(1.024)
    assert CPU_SMOLLM2_135M.decode_step_seconds(1) == pytest.approx(1 / 20)
    assert CPU_SMOLLM2_135M.decode_step_seconds(4) == pytest.approx(4 / 60)
    assert GPU_LLAMA8B_H100.kv_bytes_per_token == kv_bytes_per_token(
        layers=32, kv_heads=8, head_dim=128, dtype_bytes=2) == 131072


def test_multi_agent_sessions_share_context_blocks_per_round() -> None:
    w = MultiAgentWorkload(sessions=2, agents=3, rounds=3, context_tokens=64, turn_tokens=32,
                           growth_tokens=64, session_interval_s=1.0, round_interval_s=5.0,
                           block_tokens=32)
    reqs = w.requests()
    assert len(reqs) == 18 and [r.id for r in reqs] == list(range(18))
    s0 = [r for r in reqs if r.session == 0]
    by_round = [s0[i:i + 3] for i in (0, 3, 6)]
    for r, group in enumerate(by_round):
        ctx = {g.blocks[: g.ip_blocks] for g in group}
        assert len(ctx) == 1 and len(next(iter(ctx))) == 2 + 2 * r  # 64 + r * 64 tokens
        assert {g.module for g in group} == {"agent0", "agent1", "agent2"}
        assert {g.arrival_s for g in group} == {5.0 * r}
        assert all(g.input_tokens == 32 * len(g.blocks) for g in group)
    # a round's context extends the previous one's
    assert by_round[2][0].blocks[:4] == by_round[1][0].blocks[:4]
    # sessions never share blocks
    s1 = {b for r in reqs if r.session == 1 for b in r.blocks}
    assert not s1 & {b for r in s0 for b in r.blocks}


def test_workload_validation() -> None:
    with pytest.raises(ValueError):
        MultiAgentWorkload(sessions=1, agents=1, context_tokens=100, block_tokens=32)
    with pytest.raises(ValueError):
        MultiAgentWorkload(sessions=0, agents=1)


def test_trace_scaling() -> None:
    t = [TraceRequest(2000, 1000, 10, (0, 1)), TraceRequest(3000, 1, 1, (0,))]
    reqs = from_trace(t, token_scale=16, time_scale=0.5)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in reqs] == [(1.0, 63, 1), (1.5, 1, 1)]
    with pytest.raises(ValueError):
        from_trace(t, token_scale=3)
