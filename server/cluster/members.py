"""The workers as the router knows them, and how their facts become the API's.

A :class:`Member` is one worker: its facts (``WorkerInfo``), whether it answers, its last
counters, and the router's own books on it (prefill work and KV bytes in flight, the measured
bandwidth of its link). Joining is checked here: one cluster serves one prefill family.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from server.backend import AgentCard, EngineFacts
from server.cluster.messages import WorkerInfo, WorkerStats
from server.engine.errors import InvalidRequest


class WorkerDown(Exception):
    """A worker did not answer (connection refused or dropped)."""


@dataclass(slots=True)
class Member:
    """One worker as the router sees it."""

    id: int
    url: str
    info: WorkerInfo | None = None
    alive: bool = False
    stats: WorkerStats | None = None
    queued_tokens: int = 0  # prefill work the router has sent and not seen finish
    queued_bytes: int = 0  # KV on its way out of this (prefill) worker
    link_bytes_s: float | None = None  # measured, EWMA

    @property
    def role(self) -> str | None:
        return None if self.info is None else self.info.role

    def serves(self, module: str) -> bool:
        return self.info is not None and any(a.name == module for a in self.info.agents)


def facts_of(infos: Sequence[WorkerInfo], tokenizer: Any) -> EngineFacts:
    """The API's facts from the workers' own: one family, one block size, every decode agent."""
    if not infos:
        raise ValueError("a cluster needs at least one worker")
    families = {i.family for i in infos}
    if len(families) > 1:
        raise InvalidRequest(f"workers serve different families {sorted(f[:12] for f in families)}: one cluster "
                             "runs one base model in one KV dtype")
    if not any(i.role == "decode" for i in infos):
        raise InvalidRequest("a cluster needs at least one decode worker")
    agents: dict[str, AgentCard] = {}
    for info in infos:
        if info.role != "decode":
            continue
        for a in info.agents:
            card = AgentCard(a.name, a.kind, a.family, a.shares_prefill, a.placement, a.reason, a.recompute_layers,
                             None if a.fidelity is None else a.fidelity.model_dump())
            if agents.setdefault(a.name, card) != card:
                raise InvalidRequest(f"agent {a.name!r} is served with different modules by different workers")
    first = infos[0]
    return EngineFacts(first.family, agents, tokenizer, first.block_size, min(i.max_context for i in infos))


def check_worker(info: WorkerInfo, facts: EngineFacts) -> None:
    """Refuse a (re)joining worker of another family, or a decode worker serving agents the
    router's API does not list."""
    if info.family != facts.family:
        raise InvalidRequest(f"worker {info.url} serves family {info.family[:12]}, this cluster "
                             f"{facts.family[:12]}: a worker must run the cluster's base model and KV dtype")
    if info.role == "decode":
        unknown = [a.name for a in info.agents if a.name not in facts.agents]
        if unknown:
            raise InvalidRequest(f"worker {info.url} serves agents {unknown} the router does not know; "
                                 "restart the router with them")
