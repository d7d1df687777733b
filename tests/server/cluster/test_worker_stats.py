"""A worker's stats carry every engine counter whole: a counter added to the engine's snapshot
and forgotten in ``WorkerStats`` would be dropped between a worker and the router's sums."""

from __future__ import annotations

import dataclasses

from server.backend import EngineSnapshot
from server.cluster.messages import WorkerStats


def test_every_engine_counter_crosses_to_the_router_with_its_value():
    names = [f.name for f in dataclasses.fields(EngineSnapshot)]
    missing = sorted(set(names) - set(WorkerStats.model_fields))
    assert not missing, f"WorkerStats lacks engine counters {missing}: add them to server/cluster/messages.py"
    snap = EngineSnapshot(**{name: i + 1 for i, name in enumerate(names)})
    back = WorkerStats.model_validate_json(WorkerStats(role="decode", **dataclasses.asdict(snap)).model_dump_json())
    assert {name: getattr(back, name) for name in names} == dataclasses.asdict(snap)
