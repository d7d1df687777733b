"""Placement policies: pure functions over frozen snapshots of workers and links.

One noun per module::

    snapshot.py     RequestSnapshot, WorkerSnapshot, LinkSnapshot, ClusterSnapshot, Role
    affinity.py     choose_worker(): longest cached prefix, balanced against queued work
    offload.py      decide_prefill(): private, local or offloaded prefill, and why;
                    decide_route(): affinity, then decide_prefill (the "offload" policy)
    placement.py    place(): the placement policy of a name (registered there), the one call
    replication.py  plan_replication(): hot prefixes to copy to decode workers, within a budget

Every decision carries a reason enum (``ChoiceReason``, ``PrefillReason``,
``ReplicationReason``) whose ``.value`` is a stable metric label. Nothing here holds state or
reads a clock: the simulator (:mod:`server.sim`) and the router build snapshots and act on the
answers.

>>> from server.policy import ClusterSnapshot, RequestSnapshot, Role, WorkerSnapshot, place
>>> c = ClusterSnapshot("fam", kv_bytes_per_token=23040, decode=[WorkerSnapshot(0, Role.DECODE, "fam")])
>>> place(RequestSnapshot(1, "coder", "fam", 300), c).prefill.reason.value
'below_threshold'
"""

from server.policy.affinity import AffinityConfig, ChoiceReason, WorkerChoice, choose_worker
from server.policy.offload import (
    OffloadPolicy,
    PrefillDecision,
    PrefillReason,
    RouteDecision,
    Where,
    decide_prefill,
    decide_route,
)
from server.policy.placement import PlacementPolicy, UnknownPolicy, place
from server.policy.replication import (
    PrefixHeat,
    Replication,
    ReplicationPlan,
    ReplicationReason,
    plan_replication,
)
from server.policy.snapshot import (
    ClusterSnapshot,
    LinkSnapshot,
    RequestSnapshot,
    Role,
    WorkerSnapshot,
)

__all__ = [
    "AffinityConfig",
    "ChoiceReason",
    "ClusterSnapshot",
    "LinkSnapshot",
    "OffloadPolicy",
    "PlacementPolicy",
    "PrefillDecision",
    "PrefillReason",
    "PrefixHeat",
    "Replication",
    "ReplicationPlan",
    "ReplicationReason",
    "RequestSnapshot",
    "Role",
    "RouteDecision",
    "UnknownPolicy",
    "Where",
    "WorkerChoice",
    "WorkerSnapshot",
    "choose_worker",
    "decide_prefill",
    "decide_route",
    "place",
    "plan_replication",
]
