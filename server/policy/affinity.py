"""Prefix-cache affinity: which worker of a pool takes a request.

The rule (the shape of SGLang's cache-aware router, with prefill work as the load)::

    candidates = workers below max_occupancy  (all of them if every one is above)
    if the pool is imbalanced:                 max load - min load > balance_abs_tokens
                                               and max load > balance_rel * min load
        -> the least loaded                    reason LEAST_LOADED
    else
        -> the longest cached prefix           reason LONGEST_PREFIX
           ties: least loaded, then the smaller decode batch, then the lowest id

Load is ``queued_tokens`` (prefill work ahead). Going to the worker with the longest prefix is
what keeps one copy of a hot context hot; the imbalance escape keeps one popular prefix from
piling every request onto one worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from server.policy.snapshot import WorkerSnapshot


class ChoiceReason(Enum):
    NO_CANDIDATE = "no_candidate"
    ONLY_CANDIDATE = "only_candidate"
    LONGEST_PREFIX = "longest_prefix"
    LEAST_LOADED = "least_loaded"
    """Chosen for load: the pool was imbalanced, or prefixes tied and this one had less work."""
    LOWEST_ID = "lowest_id"
    """A complete tie (same prefix, load and batch): the lowest id, so decisions are stable."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AffinityConfig:
    """Knobs of :func:`choose_worker`. Defaults suit 512-to-2k-token blocks of work."""

    balance_abs_tokens: int = 8192
    balance_rel: float = 2.0
    max_occupancy: float = 0.95


@dataclass(frozen=True, slots=True)
class WorkerChoice:
    """The chosen worker (None when there is none) and why."""

    worker: WorkerSnapshot | None
    reason: ChoiceReason

    @property
    def worker_id(self) -> int | None:
        return None if self.worker is None else self.worker.id


def choose_worker(
    workers: Sequence[WorkerSnapshot], config: AffinityConfig = AffinityConfig()
) -> WorkerChoice:
    """Pick the worker for a request from ``workers`` (already filtered to those that may serve it).

    >>> from server.policy.snapshot import Role, WorkerSnapshot as W
    >>> ws = [W(0, Role.DECODE, "f", cached_tokens=0), W(1, Role.DECODE, "f", cached_tokens=1024)]
    >>> c = choose_worker(ws); c.worker_id, c.reason.value
    (1, 'longest_prefix')
    >>> choose_worker([]).reason.value
    'no_candidate'
    """
    if not workers:
        return WorkerChoice(None, ChoiceReason.NO_CANDIDATE)
    if len(workers) == 1:
        return WorkerChoice(workers[0], ChoiceReason.ONLY_CANDIDATE)
    candidates = [w for w in workers if w.occupancy < config.max_occupancy] or list(workers)
    if len(candidates) == 1:
        return WorkerChoice(candidates[0], ChoiceReason.LEAST_LOADED)

    loads = [w.queued_tokens for w in candidates]
    lo, hi = min(loads), max(loads)
    if hi - lo > config.balance_abs_tokens and hi > config.balance_rel * lo:
        best = min(candidates, key=lambda w: (w.queued_tokens, w.running, -w.cached_tokens, w.id))
        return WorkerChoice(best, ChoiceReason.LEAST_LOADED)

    ranked = sorted(candidates, key=lambda w: (-w.cached_tokens, w.queued_tokens, w.running, w.id))
    best, second = ranked[0], ranked[1]
    if best.cached_tokens > second.cached_tokens:
        return WorkerChoice(best, ChoiceReason.LONGEST_PREFIX)
    if (best.queued_tokens, best.running) < (second.queued_tokens, second.running):
        return WorkerChoice(best, ChoiceReason.LEAST_LOADED)
    return WorkerChoice(best, ChoiceReason.LOWEST_ID)
