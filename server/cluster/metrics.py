"""The router's own Prometheus figures, next to the engine counters summed over its workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from server.cluster.router import ClusterBackend


class RouterCollector(Collector):
    """Routing decisions by reason, KV moved between workers, workers up and down.

    KV figures are the workers' own counters as of the last health check (at most
    ``health_interval`` old)."""

    def __init__(self, backend: ClusterBackend) -> None:
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
        yield CounterMetricFamily("agentshare_kv_transfer_failures", "Transfers that failed (recomputed by the "
                                  "decode worker)", value=b.stats.transfer_failures)
        yield CounterMetricFamily("agentshare_route_retries", "Requests moved to another decode worker",
                                  value=b.stats.retries)
        workers = GaugeMetricFamily("agentshare_workers", "Workers by role and state", labels=["role", "state"])
        for role in ("prefill", "decode"):
            for state, alive in (("up", True), ("down", False)):
                workers.add_metric([role, state], sum(1 for m in b.members if m.role == role and m.alive is alive))
        yield workers
