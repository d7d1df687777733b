"""choose_worker on hand-made snapshots: ties, empty pools, imbalance and occupancy boundaries."""

from server.policy import AffinityConfig, ChoiceReason, Role, WorkerSnapshot, choose_worker


def w(id: int, cached: int = 0, queued: int = 0, running: int = 0, occ: float = 0.0) -> WorkerSnapshot:
    return WorkerSnapshot(id, Role.DECODE, "fam", cached_tokens=cached, queued_tokens=queued,
                          running=running, occupancy=occ)


def test_empty_pool_has_no_choice() -> None:
    c = choose_worker([])
    assert c.worker is None and c.worker_id is None and c.reason is ChoiceReason.NO_CANDIDATE


def test_single_worker_is_chosen_whatever_its_state() -> None:
    c = choose_worker([w(3, queued=10**6, occ=1.0)])
    assert (c.worker_id, c.reason) == (3, ChoiceReason.ONLY_CANDIDATE)


def test_longest_cached_prefix_wins() -> None:
    c = choose_worker([w(0, cached=512), w(1, cached=2048, queued=100), w(2, cached=1024)])
    assert (c.worker_id, c.reason) == (1, ChoiceReason.LONGEST_PREFIX)


def test_prefix_tie_goes_to_less_work_then_smaller_batch() -> None:
    c = choose_worker([w(0, cached=512, queued=300), w(1, cached=512, queued=200)])
    assert (c.worker_id, c.reason) == (1, ChoiceReason.LEAST_LOADED)
    c = choose_worker([w(0, running=5), w(1, running=2), w(2, running=3)])
    assert (c.worker_id, c.reason) == (1, ChoiceReason.LEAST_LOADED)


def test_complete_tie_takes_the_lowest_id_in_any_order() -> None:
    for ws in ([w(4), w(2), w(7)], [w(7), w(4), w(2)]):
        c = choose_worker(ws)
        assert (c.worker_id, c.reason) == (2, ChoiceReason.LOWEST_ID)


def test_imbalance_overrides_affinity() -> None:
    cfg = AffinityConfig(balance_abs_tokens=1000, balance_rel=2.0)
    c = choose_worker([w(0, cached=4096, queued=5000), w(1, cached=0, queued=0)], cfg)
    assert (c.worker_id, c.reason) == (1, ChoiceReason.LEAST_LOADED)


def test_imbalance_boundaries_are_strict() -> None:
    cfg = AffinityConfig(balance_abs_tokens=1000, balance_rel=2.0)
    # difference exactly at the absolute bound: still balanced, affinity decides
    c = choose_worker([w(0, cached=4096, queued=1000), w(1, queued=0)], cfg)
    assert (c.worker_id, c.reason) == (0, ChoiceReason.LONGEST_PREFIX)
    c = choose_worker([w(0, cached=4096, queued=1001), w(1, queued=0)], cfg)
    assert (c.worker_id, c.reason) == (1, ChoiceReason.LEAST_LOADED)
    # difference above the bound but max exactly rel * min: balanced
    c = choose_worker([w(0, cached=4096, queued=4000), w(1, queued=2000)], cfg)
    assert (c.worker_id, c.reason) == (0, ChoiceReason.LONGEST_PREFIX)


def test_full_workers_are_skipped_unless_all_are_full() -> None:
    cfg = AffinityConfig(max_occupancy=0.9)
    c = choose_worker([w(0, cached=4096, occ=0.9), w(1, occ=0.5), w(2, occ=0.95)], cfg)
    assert (c.worker_id, c.reason) == (1, ChoiceReason.LEAST_LOADED)
    c = choose_worker([w(0, cached=4096, occ=0.99), w(1, occ=0.95)], cfg)
    assert (c.worker_id, c.reason) == (0, ChoiceReason.LONGEST_PREFIX)
