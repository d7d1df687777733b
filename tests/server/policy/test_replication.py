import pytest

from server.policy import PrefixHeat, ReplicationReason, plan_replication


def heat(pid: int, nbytes: int, holders: set[int], hits: dict[int, int]) -> PrefixHeat:
    return PrefixHeat(pid, nbytes, frozenset(holders), hits)


def test_nothing_to_plan() -> None:
    plan = plan_replication([], budget_bytes=10**9)
    assert plan.copies == () and plan.skipped == () and plan.nbytes == 0


def test_copies_to_hot_non_holders_only() -> None:
    p = heat(1, 100, {0}, {0: 9, 1: 2, 2: 1, 3: 5})
    plan = plan_replication([p], budget_bytes=10**6, min_hits=2)
    assert [(c.worker_id, c.reason) for c in plan.copies] == [
        (3, ReplicationReason.HOT_PREFIX), (1, ReplicationReason.HOT_PREFIX)
    ]


def test_min_hits_boundary() -> None:
    p = heat(1, 100, set(), {0: 2, 1: 1})
    assert [c.worker_id for c in plan_replication([p], budget_bytes=1000, min_hits=2).copies] == [0]
    assert plan_replication([p], budget_bytes=1000, min_hits=3).copies == ()


def test_hottest_first_within_budget_exactly() -> None:
    cold = heat(1, 60, set(), {0: 3})
    hot = heat(2, 100, set(), {0: 4, 1: 4})
    plan = plan_replication([cold, hot], budget_bytes=200, min_hits=2)
    assert [(c.prefix_id, c.worker_id) for c in plan.copies] == [(2, 0), (2, 1)]
    assert plan.nbytes == 200  # the budget is inclusive
    assert [(s.prefix_id, s.reason) for s in plan.skipped] == [(1, ReplicationReason.OVER_BUDGET)]


def test_a_smaller_prefix_still_fits_after_a_skip() -> None:
    big = heat(1, 500, set(), {0: 10})
    small = heat(2, 50, set(), {0: 3})
    plan = plan_replication([big, small], budget_bytes=100)
    assert [c.prefix_id for c in plan.copies] == [2] and [s.prefix_id for s in plan.skipped] == [1]


def test_ties_are_stable() -> None:
    a, b = heat(2, 10, set(), {5: 3, 4: 3}), heat(1, 10, set(), {5: 3, 4: 3})
    plan = plan_replication([a, b], budget_bytes=1000)
    assert [(c.prefix_id, c.worker_id) for c in plan.copies] == [(1, 4), (1, 5), (2, 4), (2, 5)]


def test_zero_budget_and_bad_arguments() -> None:
    assert plan_replication([heat(1, 1, set(), {0: 5})], budget_bytes=0).copies == ()
    with pytest.raises(ValueError):
        plan_replication([], budget_bytes=-1)
    with pytest.raises(ValueError):
        plan_replication([], budget_bytes=1, min_hits=0)
