"""The server's own counters while a benchmark runs: its Prometheus ``/metrics``, sampled.

Every gauge and counter of the ``agentshare_`` and ``vllm:`` families is kept, and of each
histogram its ``_sum`` and ``_count`` (the client times every request itself, but only the server
knows how long a request queued: their growth over the run gives the mean). A counter is reported
as its growth over the run, a gauge as its mean and maximum over the samples. An endpoint without ``/metrics`` (or one
that fails) is reported so, not guessed.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("agentshare_", "vllm:")


def parse(text: str) -> tuple[dict[str, float], set[str]]:
    """The samples of kept families (``name{label="v",...}`` -> value) and which are counters
    (a histogram's ``_sum`` and ``_count`` among them).

    >>> values, counters = parse('# TYPE agentshare_kv_evictions_total counter\\n'
    ...                          'agentshare_kv_evictions_total 3.0\\n'
    ...                          '# TYPE vllm:num_requests_waiting gauge\\n'
    ...                          'vllm:num_requests_waiting{model_name="m"} 2.0\\n'
    ...                          '# TYPE other_metric gauge\\nother_metric 1.0\\n'
    ...                          '# TYPE agentshare_queue_seconds histogram\\n'
    ...                          'agentshare_queue_seconds_bucket{le="+Inf"} 2.0\\n'
    ...                          'agentshare_queue_seconds_count 2.0\\nagentshare_queue_seconds_sum 0.5\\n')
    >>> values
    {'agentshare_kv_evictions_total': 3.0, 'vllm:num_requests_waiting{model_name="m"}': 2.0, 'agentshare_queue_seconds_count': 2.0, 'agentshare_queue_seconds_sum': 0.5}
    >>> sorted(counters)
    ['agentshare_kv_evictions_total', 'agentshare_queue_seconds_count', 'agentshare_queue_seconds_sum']
    """
    values: dict[str, float] = {}
    counters: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.type not in ("counter", "gauge", "histogram") or not family.name.startswith(PREFIXES):
            continue
        for s in family.samples:
            if s.name.endswith("_created") or (family.type == "histogram" and s.name.endswith("_bucket")):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            values[key] = float(s.value)
            if family.type in ("counter", "histogram"):
                counters.add(key)
    return values, counters


class Sampler:
    """Samples ``url``/metrics every ``every`` seconds until :meth:`stop`; then :meth:`report`."""

    def __init__(self, client: httpx.AsyncClient, url: str, every: float = 1.0) -> None:
        self.client, self.url, self.every = client, url, every
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.counters: set[str] = set()
        self.error: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def once(self) -> None:
        try:
            r = await self.client.get(f"{self.url}/metrics", timeout=10.0)
            r.raise_for_status()
            values, counters = parse(r.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"[:300]
            return
        self.samples.append((time.perf_counter(), values))
        self.counters |= counters

    async def _loop(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(self.every)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.once()  # the counters as the run ended

    def report(self) -> dict[str, Any]:
        """``{"counters": {key: growth}, "gauges": {key: {"mean", "max"}}, "samples": n}``, or
        ``{"unavailable": why}`` when no sample came back."""
        if not self.samples:
            return {"unavailable": self.error or "no sample taken"}
        first, last = self.samples[0][1], self.samples[-1][1]
        series: dict[str, list[float]] = defaultdict(list)
        for _, values in self.samples:
            for k, v in values.items():
                series[k].append(v)
        out: dict[str, Any] = {
            "samples": len(self.samples),
            "counters": {k: last[k] - first.get(k, 0.0) for k in sorted(last) if k in self.counters},
            "gauges": {k: {"mean": sum(v) / len(v), "max": max(v)} for k, v in sorted(series.items())
                       if k not in self.counters},
        }
        if self.error:
            out["last_error"] = self.error
        return out
