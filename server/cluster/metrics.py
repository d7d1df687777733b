"""The router's own figures (:class:`RouterStats`) and their Prometheus view, next to the engine
counters summed over its workers.

>>> from types import SimpleNamespace
>>> router = SimpleNamespace(stats=RouterStats(retries=2), members=[])   # a RouterFigures
>>> figures = {m.name: m for m in RouterCollector(router).collect()}
>>> figures["agentshare_route_retries"].samples[0].value
2
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.cluster.members import Member


@dataclass(slots=True)
class RouterStats:
    """What the router counts: routing decisions, retries, failed transfers, membership changes."""

    decisions: Tally[str] = field(default_factory=Tally)  # prefill reason -> requests
    retries: int = 0
    transfer_failures: int = 0
    workers_down: int = 0
    rejoined: int = 0


class RouterFigures(Protocol):
    """What the collector reads at scrape time (the :class:`~server.cluster.router.ClusterBackend`)."""

    @property
    def stats(self) -> RouterStats: ...

    @property
    def members(self) -> Sequence[Member]: ...


class RouterCollector(Collector):
    """Routing decisions by reason, KV moved between workers, workers up and down.

    KV figures are the workers' own counters as of the last health check (at most
    ``health_interval`` old)."""

    def __init__(self, backend: RouterFigures) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Metric]:
        b = self.backend
        decisions = CounterMetricFamily("agentshare_route_decisions", "Requests routed, by where their shared "
                                        "prefix was prefilled and why (server.policy PrefillReason)", labels=["reason"])
        for reason, n in sorted(b.stats.decisions.items()):
            decisions.add_metric([reason], n)
        yield decisions
        moved = CounterMetricFamily("agentshare_kv_transfer_bytes", "KV bytes sent by prefill workers", labels=["link"])
        seconds = CounterMetricFamily("agentshare_kv_transfer_seconds", "Time moving KV", labels=["link"])
        for m in b.members:
            if m.stats is not None:
                for link, fig in m.stats.sent.items():
                    moved.add_metric([f"{m.url}->{link}"], fig.bytes)
                    seconds.add_metric([f"{m.url}->{link}"], fig.seconds)
        yield moved
        yield seconds
        imported = CounterMetricFamily("agentshare_kv_imported_tokens", "KV tokens a decode worker received over "
                                       "a link and committed, by payload codec", labels=["worker", "codec"])
        received = CounterMetricFamily("agentshare_kv_received_bytes", "KV bytes a decode worker received, by "
                                       "link (transport://peer)", labels=["worker", "link"])
        for m in b.members:
            if m.stats is not None:
                for codec, tokens in sorted(m.stats.imported_tokens.items()):
                    imported.add_metric([m.url, codec], tokens)
                for link, fig in sorted(m.stats.received.items()):
                    received.add_metric([m.url, link], fig.bytes)
        yield imported
        yield received
        yield CounterMetricFamily("agentshare_kv_transfer_failures", "Transfers that failed (recomputed by the "
                                  "decode worker)", value=b.stats.transfer_failures)
        yield CounterMetricFamily("agentshare_route_retries", "Requests moved to another decode worker",
                                  value=b.stats.retries)
        workers = GaugeMetricFamily("agentshare_workers", "Workers by role and state", labels=["role", "state"])
        for role in ("prefill", "decode"):
            for state, alive in (("up", True), ("down", False)):
                workers.add_metric([role, state], sum(1 for m in b.members if m.role == role and m.alive is alive))
        yield workers
