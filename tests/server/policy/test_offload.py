"""decide_prefill / place on hand-made snapshots."""

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from server.policy import (
    ChoiceReason,
    ClusterSnapshot,
    LinkSnapshot,
    OffloadPolicy,
    PrefillReason,
    RequestSnapshot,
    Role,
    Where,
    WorkerSnapshot,
    decide_prefill,
    place,
)

KV = 100  # bytes per token


def pw(id: int, cached: int = 0, queued: int = 0, family: str = "fam", rate: float = 1000.0) -> WorkerSnapshot:
    return WorkerSnapshot(id, Role.PREFILL, family, cached_tokens=cached, queued_tokens=queued,
                          prefill_tok_s=rate)


def dw(id: int, cached: int = 0, queued: int = 0, family: str = "fam", rate: float = 1000.0) -> WorkerSnapshot:
    return WorkerSnapshot(id, Role.DECODE, family, cached_tokens=cached, queued_tokens=queued,
                          prefill_tok_s=rate)


def link(pid: int, bw: float = 1e9, queued: float = 0.0, latency: float = 0.0) -> LinkSnapshot:
    return LinkSnapshot(pid, bandwidth_bytes_s=bw, latency_s=latency, queued_bytes=queued)


def cluster(prefill=(), links=(), decode=()) -> ClusterSnapshot:  # type: ignore[no-untyped-def]
    return ClusterSnapshot("fam", KV, prefill=list(prefill), decode=list(decode), links=list(links))


def req(tokens: int, family: str | None = "fam", module: str = "coder") -> RequestSnapshot:
    return RequestSnapshot(1, module, family, tokens)


NAIVE = OffloadPolicy(threshold_tokens=0, bandwidth_aware=False)
SELECTIVE = OffloadPolicy(threshold_tokens=1000, bandwidth_aware=False)
AWARE = OffloadPolicy(threshold_tokens=1000, bandwidth_aware=True, max_link_wait_s=1.0)
ONE_P = cluster([pw(0)], [link(0)])


def test_threshold_is_strict_off_by_one() -> None:
    d = dw(9, cached=500)
    at = decide_prefill(req(1500), d, ONE_P, SELECTIVE)  # incremental 1000 == threshold
    above = decide_prefill(req(1501), d, ONE_P, SELECTIVE)  # 1001
    assert (at.where, at.reason, at.compute_tokens) == (Where.LOCAL, PrefillReason.BELOW_THRESHOLD, 1000)
    assert (above.where, above.reason) == (Where.REMOTE, PrefillReason.OFFLOADED)


def test_remote_computes_its_own_incremental_and_ships_what_decode_lacks() -> None:
    c = cluster([pw(0, cached=1200)], [link(0)])
    dec = decide_prefill(req(3000), dw(9, cached=400), c, SELECTIVE)
    assert dec.where is Where.REMOTE and dec.prefill_worker is not None
    assert dec.compute_tokens == 1800  # 3000 - the prefill worker's 1200
    assert dec.transfer_tokens == 2600 and dec.transfer_bytes == 2600 * KV  # decode lacks 2600


def test_none_threshold_never_offloads_and_zero_offloads_everything() -> None:
    never = OffloadPolicy(threshold_tokens=None)
    assert decide_prefill(req(10**6), dw(0), ONE_P, never).reason is PrefillReason.BELOW_THRESHOLD
    fully_cached = decide_prefill(req(512), dw(0, cached=512), ONE_P, NAIVE)
    assert fully_cached.where is Where.REMOTE and fully_cached.transfer_bytes == 0


def test_foreign_module_gets_a_private_local_prefill() -> None:
    for family in (None, "other-family"):
        dec = decide_prefill(req(10**5, family=family), dw(0), ONE_P, NAIVE)
        assert (dec.where, dec.reason, dec.private) == (Where.LOCAL, PrefillReason.FOREIGN_MODULE, True)


def test_no_usable_prefill_worker() -> None:
    for c in (
        cluster(),  # empty prefill pool
        cluster([pw(0, family="other")], [link(0)]),  # wrong family
        cluster([pw(0)], []),  # no link to it
    ):
        assert decide_prefill(req(5000), dw(0), c, SELECTIVE).reason is PrefillReason.NO_PREFILL_WORKER


def test_saturated_link_keeps_the_prefill_local_when_bandwidth_aware() -> None:
    busy = cluster([pw(0)], [link(0, bw=1e6, queued=1e6 + 1)])  # 1.000001 s to drain
    assert decide_prefill(req(5000), dw(0), busy, AWARE).reason is PrefillReason.LINK_SATURATED
    assert decide_prefill(req(5000), dw(0), busy, SELECTIVE).reason is PrefillReason.OFFLOADED
    edge = cluster([pw(0)], [link(0, bw=1e9, queued=1e9)])  # exactly max_link_wait_s: not saturated
    assert decide_prefill(req(5000), dw(0, rate=100), edge, AWARE).reason is PrefillReason.OFFLOADED


def test_saturated_link_steers_to_another_prefill_worker() -> None:
    c = cluster([pw(0, cached=4000), pw(1)], [link(0, bw=1e6, queued=1e7), link(1)])
    dec = decide_prefill(req(5000), dw(0, rate=100), c, AWARE)
    assert dec.reason is PrefillReason.OFFLOADED and dec.prefill_worker.id == 1  # type: ignore[union-attr]
    dec = decide_prefill(req(5000), dw(0, rate=100), c, SELECTIVE)  # blind: affinity picks 0
    assert dec.prefill_worker.id == 0  # type: ignore[union-attr]


def test_prefill_worker_affinity_prefers_the_cached_prefix() -> None:
    c = cluster([pw(0), pw(1, cached=3000)], [link(0), link(1)])
    dec = decide_prefill(req(5000), dw(0), c, SELECTIVE)
    assert dec.prefill_worker.id == 1 and dec.compute_tokens == 2000  # type: ignore[union-attr]


def test_remote_slower_than_local_counting_queues() -> None:
    # remote: 5000 tokens at 1000 tok/s = 5 s, + 5e5 B at 1e6 B/s = 0.5 s -> 5.5 s
    balanced = replace(AWARE, balance_queues=True)
    slow_p = cluster([pw(0)], [link(0, bw=1e6)])
    dec = decide_prefill(req(5000), dw(0, rate=2000), slow_p, balanced)  # local 2.5 s
    assert (dec.where, dec.reason) == (Where.LOCAL, PrefillReason.REMOTE_SLOWER)
    assert dec.est_local_s == 2.5 and dec.est_remote_s == 5.5 and dec.compute_tokens == 5000
    dec = decide_prefill(req(5000), dw(0, rate=500), slow_p, balanced)  # local 10 s
    assert dec.reason is PrefillReason.OFFLOADED and dec.est_remote_s == 5.5


def test_remote_slower_than_local_by_the_link_alone() -> None:
    # without balance_queues only the link's 0.5 s (+0.25 s queued) is weighed against local
    c = cluster([pw(0, queued=10**6)], [link(0, bw=1e6, queued=2.5e5)])
    assert decide_prefill(req(5000), dw(0, rate=2000), c, AWARE).reason is PrefillReason.OFFLOADED
    dec = decide_prefill(req(5000), dw(0, rate=8000), c, AWARE)  # local 0.625 s < 0.75 s
    assert (dec.where, dec.reason) == (Where.LOCAL, PrefillReason.REMOTE_SLOWER)


def test_place_on_empty_and_mixed_clusters() -> None:
    p = place(req(100), cluster())
    assert p.decode.reason is ChoiceReason.NO_CANDIDATE and p.prefill.where is Where.NOWHERE
    assert p.prefill.reason is PrefillReason.NO_DECODE_WORKER
    c = cluster([pw(0)], [link(0)], [dw(0, family="other", cached=99), dw(1)])
    assert place(req(100), c).decode.worker_id == 1  # only its family's decode workers
    p = place(req(100, family="other"), c)  # a foreign module may use any decode worker
    assert p.decode.worker_id == 0 and p.prefill.reason is PrefillReason.FOREIGN_MODULE


def test_place_short_local_long_offloaded() -> None:
    c = cluster([pw(0)], [link(0)], [dw(0), dw(1)])
    assert place(req(800), c, SELECTIVE).prefill.where is Where.LOCAL
    assert place(req(8000), c, SELECTIVE).prefill.where is Where.REMOTE


@given(
    prompt=st.integers(1, 20000), cached=st.integers(0, 20000),
    lo=st.integers(0, 20000), hi=st.integers(0, 20000),
)
def test_offload_is_monotone_in_the_threshold(prompt: int, cached: int, lo: int, hi: int) -> None:
    lo, hi = min(lo, hi), max(lo, hi)
    d = dw(0, cached=min(cached, prompt))
    at_hi = decide_prefill(req(prompt), d, ONE_P, OffloadPolicy(threshold_tokens=hi, bandwidth_aware=False))
    at_lo = decide_prefill(req(prompt), d, ONE_P, OffloadPolicy(threshold_tokens=lo, bandwidth_aware=False))
    if at_hi.where is Where.REMOTE:
        assert at_lo.where is Where.REMOTE
    assert at_hi.where is (Where.REMOTE if d.incremental(prompt) > hi else Where.LOCAL)
