"""Tiny scenarios whose timings are computed by hand (see conftest: TOY profile)."""

from dataclasses import replace

import pytest

from server.policy import OffloadPolicy
from server.sim import SimRequest, Simulator
from tests.server.sim.conftest import LOCAL, NAIVE, TOY, toy_cluster

approx = lambda x: pytest.approx(x, abs=1e-9)  # noqa: E731


def agent(id: int, module: str, ctx: tuple[int, ...], turn: int, *, t: float = 0.0, out: int = 3,
          family: str | None = "fam") -> SimRequest:
    blocks = (*ctx, turn)
    return SimRequest(id, t, len(blocks) * 100, out, blocks, module=module, family=family,
                      ip_blocks=len(ctx))


def times(res) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    return [(r.ttft, r.e2e) for r in res.records]


def test_one_request_local() -> None:
    # 500 tokens in one chunk: 0.5 s -> first token; 2 more tokens at 0.1 s each
    res = Simulator(toy_cluster()).run([SimRequest(0, 0.0, 500, 3, (1, 2, 3, 4, 5))])
    r = res.records[0]
    assert (r.ttft, r.e2e, r.tpot) == (approx(0.5), approx(0.7), approx(0.1))
    assert (r.where, r.reason, r.compute_tokens, r.cached_tokens) == ("local", "below_threshold", 500, 0)
    assert res.summary.kv_bytes_moved == 0 and res.unfinished == 0


def test_one_request_offloaded() -> None:
    # prefill 0.5 s; 500 tokens x 1000 B at 1e6 B/s = 0.5 s after it; 0.01 s latency; 2 steps
    res = Simulator(toy_cluster(policy=NAIVE)).run([SimRequest(0, 0.0, 500, 3, (1, 2, 3, 4, 5))])
    r = res.records[0]
    assert (r.ttft, r.e2e) == (approx(1.01), approx(1.21))
    assert (r.where, r.transfer_bytes) == ("remote", 500_000)
    assert res.summary.kv_bytes_moved == 500_000 and res.summary.offloaded == 1


def test_two_agents_share_one_prefill_of_their_context() -> None:
    # agent a: 500 tokens, 0 -> 0.5. agent b hits a's 400 in-flight context tokens and waits for
    # them; at 0.5 its 100-token chunk (0.1 s) rides with a's decode step (0.1 s) -> 0.7.
    # Then both decode: a's last token at 0.8, b's at 0.9.
    ctx = (1, 2, 3, 4)
    res = Simulator(toy_cluster()).run([agent(0, "a", ctx, 10), agent(1, "b", ctx, 11)])
    assert times(res) == [(approx(0.5), approx(0.8)), (approx(0.7), approx(0.9))]
    b = res.records[1]
    assert (b.cached_tokens, b.compute_tokens, b.cross_module_tokens) == (400, 100, 400)
    assert res.summary.hit_ratio == approx(0.4)
    assert res.summary.cross_module_hit_ratio == approx(0.4)


def test_module_keyed_caches_pay_two_prefills() -> None:
    # sharing off: b computes all 500 tokens after a: 0.5 + (0.5 + 0.1) = 1.1; then 1.2, 1.3
    ctx = (1, 2, 3, 4)
    res = Simulator(toy_cluster(cross_module_sharing=False)).run(
        [agent(0, "a", ctx, 10), agent(1, "b", ctx, 11)]
    )
    assert times(res) == [(approx(0.5), approx(1.2)), (approx(1.1), approx(1.3))]
    assert res.summary.hit_ratio == 0.0


def test_same_module_reuses_its_own_blocks_when_sharing_is_off() -> None:
    ctx = (1, 2, 3, 4)
    res = Simulator(toy_cluster(cross_module_sharing=False)).run(
        [agent(0, "a", ctx, 10, out=1), agent(1, "a", ctx, 11, t=5.0, out=1)]
    )
    assert res.records[1].cached_tokens == 400 and res.records[1].cross_module_tokens == 0


def test_foreign_module_prefills_privately() -> None:
    ctx = (1, 2, 3, 4)
    res = Simulator(toy_cluster(policy=NAIVE)).run(
        [agent(0, "a", ctx, 10, out=1), agent(1, "x", ctx, 11, t=5.0, out=1, family=None)]
    )
    x = res.records[1]
    assert (x.where, x.reason, x.cached_tokens, x.compute_tokens) == ("local", "foreign_module", 0, 500)
    assert x.ttft == approx(0.5)


def test_saturated_link_serialises_transfers() -> None:
    # two distinct 500-token prompts, offloaded; link 0.5e6 B/s -> 1.0 s per transfer.
    # r0: prefill 0-0.5, sent max(0+1, 0.5+1) = 1.5, +0.01.  r1: prefill 0.5-1.0, but the link
    # is busy until 1.5: sent 2.5, +0.01. Both decode workers idle: transfer-bound.
    reqs = [SimRequest(0, 0.0, 500, 1, (1, 2, 3, 4, 5)), SimRequest(1, 0.0, 500, 1, (6, 7, 8, 9, 10))]
    res = Simulator(toy_cluster(policy=NAIVE, decode_workers=2, link_bandwidth_bytes_s=0.5e6)).run(reqs)
    assert [r.ttft for r in res.records] == [approx(1.51), approx(2.51)]
    assert {r.decode_worker for r in res.records} == {0, 1}


def test_bandwidth_aware_policy_keeps_the_second_request_local() -> None:
    # decode-side prefill is slow (250 tok/s: 2 s for 500 tokens), so r0 goes remote (est 1.51 s).
    # r1 then sees r0's 5e5 queued bytes (1.0 s of link time) > 0.9 s: LINK_SATURATED, local on
    # a decode worker (2.0 s).
    slow_local = replace(TOY, prefill_tok_s=250.0)
    pol = OffloadPolicy(threshold_tokens=0, bandwidth_aware=True, max_link_wait_s=0.9)
    cfg = toy_cluster(policy=pol, decode_workers=2, link_bandwidth_bytes_s=0.5e6, decode_profile=slow_local)
    reqs = [SimRequest(0, 0.0, 500, 1, (1, 2, 3, 4, 5)), SimRequest(1, 0.0, 500, 1, (6, 7, 8, 9, 10))]
    res = Simulator(cfg).run(reqs)
    assert [r.reason for r in res.records] == ["offloaded", "link_saturated"]
    assert [r.ttft for r in res.records] == [approx(1.51), approx(2.0)]


def test_decode_run_is_cut_short_by_an_arrival() -> None:
    # r0: 100 tokens (0.1 s), then 10 decode steps planned 0.1 -> 1.1. r1 arrives at 0.25: the
    # run stops at the step boundary 0.3 (r0 has 8 left); r1's chunk + a step: 0.3 -> 0.5;
    # r1's last token at 0.6; r0's 6 remaining tokens: 0.6 -> 1.2.
    reqs = [SimRequest(0, 0.0, 100, 11, (1,)), SimRequest(1, 0.25, 100, 2, (2,))]
    res = Simulator(toy_cluster()).run(reqs)
    assert times(res) == [(approx(0.1), approx(1.2)), (approx(0.25), approx(0.35))]


def test_offloaded_request_waits_for_blocks_still_arriving() -> None:
    # r0 offloaded: KV on the decode worker at 1.01. r1 (same context, arrives at 0.2) is
    # placed locally (its incremental 100 <= threshold 100) but depends on r0's blocks: its
    # prefill waits for them: 1.01 + 0.1 (chunk, alone: r0 has 1 output token) = 1.11.
    pol = OffloadPolicy(threshold_tokens=100, bandwidth_aware=False)
    ctx = (1, 2, 3, 4)
    reqs = [agent(0, "a", ctx, 10, out=1), agent(1, "b", ctx, 11, t=0.2, out=1)]
    res = Simulator(toy_cluster(policy=pol)).run(reqs)
    assert [r.where for r in res.records] == ["remote", "local"]
    assert [r.ttft + r.arrival for r in res.records] == [approx(1.01), approx(1.11)]


def test_duplicate_ids_are_refused() -> None:
    with pytest.raises(ValueError):
        Simulator(toy_cluster()).run([SimRequest(0, 0.0, 1, 1, (1,)), SimRequest(0, 1.0, 1, 1, (2,))])


def test_runs_are_deterministic() -> None:
    ctx = tuple(range(20))
    reqs = [agent(i, f"m{i % 3}", ctx, 100 + i, t=0.05 * i, out=5) for i in range(30)]
    a = Simulator(toy_cluster(decode_workers=3, policy=OffloadPolicy(threshold_tokens=500))).run(reqs)
    b = Simulator(toy_cluster(decode_workers=3, policy=OffloadPolicy(threshold_tokens=500))).run(reqs)
    assert times(a) == times(b) and a.unfinished == 0
    assert LOCAL.threshold_tokens is None and TOY.layers == 1
