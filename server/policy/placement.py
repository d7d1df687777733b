"""Placement policies by name, and :func:`place`, the router's and the simulator's one call.

A placement policy is a pure function ``(request, cluster, knobs) -> RouteDecision``: the
decode worker, and where the prefill runs and why. ``knobs`` is the caller's
:class:`~server.policy.offload.OffloadPolicy` (threshold, bandwidth-awareness, affinity); a
policy reads the ones it needs. Registered::

    offload   decide_route() (offload.py): decode worker by affinity among the family's
              workers, then decide_prefill()'s local / offloaded rule          (the default)

Adding a policy: a file in ``server/policy/`` with the function; below, its import and one
``register(...)`` line. ``RouterConfig.placement_policy``, ``ClusterConfig.placement_policy`` (the
simulator) and ``--placement-policy`` then take its name.

>>> from server.policy.snapshot import ClusterSnapshot, RequestSnapshot, Role, WorkerSnapshot
>>> c = ClusterSnapshot("f", 100, decode=[WorkerSnapshot(0, Role.DECODE, "f")])
>>> place(RequestSnapshot(1, "m", "f", 64), c, name="offload").prefill.reason.value
'below_threshold'
>>> names()
('offload',)
>>> get("round-robin")
Traceback (most recent call last):
...
server.policy.placement.UnknownPolicy: unknown placement policy 'round-robin'; registered policies: offload (add one with server.policy.placement.register)
"""

from __future__ import annotations

from typing import Protocol

from server.policy import offload
from server.policy.offload import OffloadPolicy, RouteDecision
from server.policy.snapshot import ClusterSnapshot, RequestSnapshot
from server.registry import Registry, UnknownName

DEFAULT = "offload"
"""The policy :func:`place` (and the router, and the simulator) use unless told otherwise."""

_KNOBS = OffloadPolicy()


class PlacementPolicy(Protocol):
    """Where a request goes: the decode worker, and where its prefill runs, with reasons.

    Pure: it reads the frozen snapshots and the knobs, holds no state and reads no clock. Its
    ``RouteDecision`` names a worker of ``cluster.decode`` (or ``Where.NOWHERE`` when none can
    take the request) and, for ``Where.REMOTE``, a prefill worker and its link.
    """

    def __call__(
        self, request: RequestSnapshot, cluster: ClusterSnapshot, policy: OffloadPolicy, /
    ) -> RouteDecision: ...


class UnknownPolicy(UnknownName):
    """A placement policy name nothing is registered under; the message lists the ones that are."""


POLICIES = Registry[PlacementPolicy]("placement policy", plural="policies", error=UnknownPolicy,
                                     hint="add one with server.policy.placement.register")


def register(name: str, policy: PlacementPolicy, *, replace: bool = False) -> PlacementPolicy:
    """Make ``policy`` usable as ``name``; returns it. A taken name needs ``replace``."""
    return POLICIES.register(name, policy, replace=replace)


get, names, unregister = POLICIES.get, POLICIES.names, POLICIES.unregister


def place(
    request: RequestSnapshot,
    cluster: ClusterSnapshot,
    policy: OffloadPolicy = _KNOBS,
    *,
    name: str = DEFAULT,
) -> RouteDecision:
    """The router's one call: the decision of the placement policy ``name``, with knobs ``policy``.

    With the default policy: the decode worker by affinity (family requests among their
    family's decode workers; a foreign module on any, prefilling privately there), then where
    to prefill (:func:`~server.policy.offload.decide_prefill`).

    >>> from server.policy.snapshot import ClusterSnapshot, RequestSnapshot, Role
    >>> from server.policy.snapshot import WorkerSnapshot as W
    >>> c = ClusterSnapshot("f", 100, decode=[W(0, Role.DECODE, "f"), W(1, Role.DECODE, "f")])
    >>> p = place(RequestSnapshot(1, "m", "other-family", 64), c)
    >>> p.decode.worker_id, p.prefill.reason.value
    (0, 'foreign_module')
    """
    return get(name)(request, cluster, policy)


register("offload", offload.decide_route)
