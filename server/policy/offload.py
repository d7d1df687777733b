"""Where a request's prefill runs: locally on its decode worker, or offloaded to the prefill pool.

Prefill-as-a-Service's rule, with docs/design.md §2's compatibility rule in front::

    module not in the cluster's family        -> LOCAL  private prefill      FOREIGN_MODULE
    incremental = prompt - decode-side cache
    incremental <= threshold (or no threshold) -> LOCAL                       BELOW_THRESHOLD
    no prefill worker of the family            -> LOCAL                       NO_PREFILL_WORKER
    bandwidth-aware:
        every link waits > max_link_wait_s     -> LOCAL                       LINK_SATURATED
        the link alone takes longer than the
        local prefill (with balance_queues: the
        remote queue + prefill + link does)    -> LOCAL                       REMOTE_SLOWER
    otherwise                                  -> REMOTE on the affinity pick OFFLOADED

The threshold is strict: an incremental prefill of exactly ``threshold_tokens`` stays local.
Only what the decode worker lacks crosses the link: ``prompt - decode.cached_tokens`` tokens of
KV, even when the prefill worker recomputes more than that (its own cache may be shorter).

:func:`decide_route` composes the decode-worker choice (:mod:`server.policy.affinity`) and this
decision: it is the ``offload`` placement policy, the default of :func:`server.policy.place`
(:mod:`server.policy.placement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from server.policy.affinity import AffinityConfig, WorkerChoice, choose_worker
from server.policy.snapshot import ClusterSnapshot, LinkSnapshot, RequestSnapshot, WorkerSnapshot


class Where(Enum):
    LOCAL = "local"
    REMOTE = "remote"
    NOWHERE = "nowhere"  # no decode worker can take the request


class PrefillReason(Enum):
    FOREIGN_MODULE = "foreign_module"
    BELOW_THRESHOLD = "below_threshold"
    NO_PREFILL_WORKER = "no_prefill_worker"
    LINK_SATURATED = "link_saturated"
    REMOTE_SLOWER = "remote_slower"
    OFFLOADED = "offloaded"
    NO_DECODE_WORKER = "no_decode_worker"


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloadPolicy:
    """Knobs of the offload decision.

    ``threshold_tokens=None`` never offloads (homogeneous PD); ``0`` with ``bandwidth_aware=False``
    offloads everything (naive disaggregation).
    """

    threshold_tokens: int | None = 1024
    bandwidth_aware: bool = True
    max_link_wait_s: float = 1.0
    """A link whose queued bytes take longer than this to drain counts as saturated."""
    balance_queues: bool = False
    """Also weigh the prefill worker's queue and compute against the local estimate (greedy
    per-request load balancing). Off: only the link's time is weighed -- a local prefill is
    chosen when moving the KV alone would take longer than computing it here."""
    affinity: AffinityConfig = AffinityConfig()

    def __post_init__(self) -> None:
        if self.threshold_tokens is not None and self.threshold_tokens < 0:
            raise ValueError("threshold_tokens must be >= 0 or None")


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    """Where the prefill runs, what it computes and moves, and why.

    ``compute_tokens`` are computed by the chosen worker; ``transfer_tokens`` (and ``_bytes``)
    cross ``link`` (zero when local). Estimates are filled when they were computed.
    """

    where: Where
    reason: PrefillReason
    compute_tokens: int = 0
    prefill_worker: WorkerSnapshot | None = None
    link: LinkSnapshot | None = None
    transfer_tokens: int = 0
    transfer_bytes: int = 0
    est_local_s: float | None = None
    est_remote_s: float | None = None

    @property
    def private(self) -> bool:
        return self.reason is PrefillReason.FOREIGN_MODULE


@dataclass(frozen=True, slots=True)
class RouteDecision:
    decode: WorkerChoice
    prefill: PrefillDecision


def decide_prefill(
    request: RequestSnapshot,
    decode: WorkerSnapshot,
    cluster: ClusterSnapshot,
    policy: OffloadPolicy = OffloadPolicy(),
) -> PrefillDecision:
    """Decide where ``request``'s prefill runs, given the decode worker already chosen for it.

    >>> from server.policy.snapshot import ClusterSnapshot, LinkSnapshot, RequestSnapshot, Role
    >>> from server.policy.snapshot import WorkerSnapshot as W
    >>> c = ClusterSnapshot("f", kv_bytes_per_token=100, prefill=[W(0, Role.PREFILL, "f")],
    ...                     links=[LinkSnapshot(0, bandwidth_bytes_s=1e9)])
    >>> d = W(1, Role.DECODE, "f", cached_tokens=1000)
    >>> pol = OffloadPolicy(threshold_tokens=1024, bandwidth_aware=False)
    >>> decide_prefill(RequestSnapshot(1, "m", "f", 2024), d, c, pol).reason.value
    'below_threshold'
    >>> decide_prefill(RequestSnapshot(2, "m", "f", 2025), d, c, pol).transfer_bytes
    102500
    """
    local_compute = decode.incremental(request.prompt_tokens)
    local = PrefillDecision(Where.LOCAL, PrefillReason.BELOW_THRESHOLD, local_compute)
    if request.family is None or request.family != cluster.family:
        return _with(local, PrefillReason.FOREIGN_MODULE)
    if policy.threshold_tokens is None or local_compute <= policy.threshold_tokens:
        return local

    pool = [w for w in cluster.prefill if w.family == request.family]
    linked = [(w, cluster.link_of(w.id)) for w in pool]
    usable = [(w, link) for w, link in linked if link is not None]
    if not usable:
        return _with(local, PrefillReason.NO_PREFILL_WORKER)
    if policy.bandwidth_aware:
        usable = [(w, link) for w, link in usable if link.wait_seconds() <= policy.max_link_wait_s]
        if not usable:
            return _with(local, PrefillReason.LINK_SATURATED)

    choice = choose_worker([w for w, _ in usable], policy.affinity)
    assert choice.worker is not None
    worker = choice.worker
    link = next(link for w, link in usable if w.id == worker.id)
    transfer_tokens = request.prompt_tokens - decode.cached_tokens
    transfer_bytes = transfer_tokens * cluster.kv_bytes_per_token
    est_local = decode.prefill_seconds(request.prompt_tokens)
    # Store-and-forward bound: the last layer's KV leaves once the prefill ends and the link drains.
    est_remote = (
        max(worker.prefill_seconds(request.prompt_tokens), link.wait_seconds())
        + transfer_bytes / link.bandwidth_bytes_s
        + link.latency_s
    )
    remote = PrefillDecision(
        Where.REMOTE,
        PrefillReason.OFFLOADED,
        worker.incremental(request.prompt_tokens),
        worker,
        link,
        transfer_tokens,
        transfer_bytes,
        est_local,
        est_remote,
    )
    weighed = est_remote if policy.balance_queues else link.transfer_seconds(transfer_bytes)
    if policy.bandwidth_aware and weighed > est_local:
        return PrefillDecision(
            Where.LOCAL, PrefillReason.REMOTE_SLOWER, local_compute,
            est_local_s=est_local, est_remote_s=est_remote,
        )
    return remote


def decide_route(
    request: RequestSnapshot,
    cluster: ClusterSnapshot,
    policy: OffloadPolicy = OffloadPolicy(),
) -> RouteDecision:
    """The ``offload`` placement policy: the decode worker by affinity, then where to prefill.

    Family requests go to decode workers of their family; a foreign module may go to any
    decode worker (it brings its own weights) and always prefills privately there.

    >>> from server.policy.snapshot import ClusterSnapshot, RequestSnapshot, Role
    >>> from server.policy.snapshot import WorkerSnapshot as W
    >>> c = ClusterSnapshot("f", 100, decode=[W(0, Role.DECODE, "f"), W(1, Role.DECODE, "f")])
    >>> p = decide_route(RequestSnapshot(1, "m", "other-family", 64), c)
    >>> p.decode.worker_id, p.prefill.reason.value
    (0, 'foreign_module')
    """
    foreign = request.family is None or request.family != cluster.family
    candidates = list(cluster.decode) if foreign else [
        w for w in cluster.decode if w.family == request.family
    ]
    choice = choose_worker(candidates, policy.affinity)
    if choice.worker is None:
        return RouteDecision(choice, PrefillDecision(Where.NOWHERE, PrefillReason.NO_DECODE_WORKER))
    return RouteDecision(choice, decide_prefill(request, choice.worker, cluster, policy))


def _with(decision: PrefillDecision, reason: PrefillReason) -> PrefillDecision:
    return PrefillDecision(decision.where, reason, decision.compute_tokens)

