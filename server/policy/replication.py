"""Hot-prefix replication: copy a prefix that several decode workers keep asking for to them.

A prefix that requests on many decode workers hit (a shared system prompt, one task's context
read by N agents spread over workers) is cheaper to push once to each of them than to pull or
recompute per request. The plan is greedy within a byte budget::

    for each prefix, hottest first (total recent hits, then fewer bytes, then id):
        for each worker that hit it >= min_hits times and does not hold it (most hits first):
            fits in what is left of the budget?  -> copy it          HOT_PREFIX
            else                                 -> skip it          OVER_BUDGET
    prefixes under min_hits on every worker are left alone

The caller decides where the copy comes from (a holder, or the prefill worker) and when to run
it (idle link time); this module only answers *what* and *why*.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum


class ReplicationReason(Enum):
    HOT_PREFIX = "hot_prefix"
    OVER_BUDGET = "over_budget"


@dataclass(frozen=True, slots=True)
class PrefixHeat:
    """Recent demand for one cached prefix.

    ``hits`` maps a decode worker id to how many recent requests routed to it wanted this prefix;
    ``holders`` are the workers whose cache holds it now.
    """

    prefix_id: int
    nbytes: int
    holders: frozenset[int]
    hits: Mapping[int, int] = field(default_factory=dict)

    @property
    def total_hits(self) -> int:
        return sum(self.hits.values())


@dataclass(frozen=True, slots=True)
class Replication:
    prefix_id: int
    worker_id: int
    nbytes: int
    reason: ReplicationReason


@dataclass(frozen=True, slots=True)
class ReplicationPlan:
    copies: tuple[Replication, ...]
    skipped: tuple[Replication, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies)


def plan_replication(
    prefixes: Sequence[PrefixHeat], *, budget_bytes: int, min_hits: int = 2
) -> ReplicationPlan:
    """Which hot prefixes to copy to which decode workers, within ``budget_bytes``.

    >>> hot = PrefixHeat(1, nbytes=100, holders=frozenset({0}), hits={0: 5, 1: 3, 2: 1})
    >>> plan = plan_replication([hot], budget_bytes=150, min_hits=2)
    >>> [(c.prefix_id, c.worker_id) for c in plan.copies], plan.nbytes
    ([(1, 1)], 100)
    """
    if budget_bytes < 0 or min_hits < 1:
        raise ValueError("budget_bytes must be >= 0 and min_hits >= 1")
    copies: list[Replication] = []
    skipped: list[Replication] = []
    left = budget_bytes
    for p in sorted(prefixes, key=lambda p: (-p.total_hits, p.nbytes, p.prefix_id)):
        wanted = sorted(
            (w for w, n in p.hits.items() if n >= min_hits and w not in p.holders),
            key=lambda w: (-p.hits[w], w),
        )
        for w in wanted:
            if p.nbytes <= left:
                copies.append(Replication(p.prefix_id, w, p.nbytes, ReplicationReason.HOT_PREFIX))
                left -= p.nbytes
            else:
                skipped.append(Replication(p.prefix_id, w, p.nbytes, ReplicationReason.OVER_BUDGET))
    return ReplicationPlan(tuple(copies), tuple(skipped))
