"""Prometheus metrics of one server, in a registry of its own (no global state).

Engine counters are read at scrape time from a snapshot taken on the engine thread; latency
histograms are observed by the API as tokens stream out::

    agentshare_prompt_tokens_total              prompt tokens, once per request, where it is served
    agentshare_prefix_tokens_total{role, source}
        role="decode": the requests served here (a decode worker's, the colocated server's, shared
            contexts); source="computed" | "reused" (this pool: shared, cached, in flight) |
            "imported" (KV that arrived over a link, on its first read). Their sum is
            agentshare_prompt_tokens_total.
        role="prefill": prefills run for a request another worker serves (a prefill worker's
            transfer jobs, not requests): source="computed" | "reused". Never in the prompt tokens.
    agentshare_prefill_tokens_total{source="computed"|"cached"}   positions computed here (both
        roles: all the prefill work) vs prompt tokens not computed by their engine (reused + imported)
    agentshare_cache_blocks_total{outcome="hit"|"miss"|"inflight_hit"|"cross_module_hit"}
    agentshare_split_prefix_tokens_total, agentshare_split_saved_layer_rows_total: prefix positions
        layer-split modules filled from the family's blocks (their top layers recomputed), and the
        (position, layer) pairs of those they read instead of computing: the prefill the split saved
    agentshare_kv_evictions_total, agentshare_kv_blocks{state=...}, agentshare_kv_bytes_held
    agentshare_requests_waiting, agentshare_requests_running, agentshare_contexts_pinned
    agentshare_time_to_first_token_seconds, agentshare_inter_token_latency_seconds,
    agentshare_e2e_request_latency_seconds, agentshare_request_queue_time_seconds (histograms,
        by agent; queue time: arrival in the engine to admission, from the request's timeline)
    agentshare_kv_transfer_time_seconds{codec} (histogram: a request's KV frames on the link)
    The histograms use vLLM's buckets (vllm:time_to_first_token_seconds,
    vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds and
    vllm:request_queue_time_seconds, vllm:nixl_xfer_time_seconds), so its dashboards apply.
    agentshare_requests_total{endpoint, status}, agentshare_rejected_requests_total{reason}

>>> m = Metrics()
>>> m.update(EngineSnapshot(prompt_tokens=100, prefill_tokens=30, cached_prompt_tokens=70))
>>> b'agentshare_prefill_tokens_total{source="cached"} 70.0' in m.render()
True
>>> b'agentshare_prefix_tokens_total{role="decode",source="reused"} 70.0' in m.render()
True

A router sums its workers' snapshots (:meth:`server.cluster.router.ClusterBackend.snapshot`):
each counter has one meaning, so the sums hold the same identities cluster-wide.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.backend import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets (vllm/v1/metrics/loggers.py; the transfer's from its NIXL KV connector)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)  # e2e and queue time
_TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)


class _EngineCollector(Collector):
    def __init__(self) -> None:
        self.snapshot = EngineSnapshot()

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        prefill = CounterMetricFamily("agentshare_prefill_tokens", "Prompt positions computed here (every role), "
                                      "or prompt tokens served without computing (reused or imported)",
                                      labels=["source"])
        prefill.add_metric(["computed"], s.prefill_tokens)
        prefill.add_metric(["cached"], s.cached_prompt_tokens)
        yield prefill
        yield CounterMetricFamily("agentshare_prompt_tokens", "Prompt tokens, once per request, where it is "
                                  "served", value=s.prompt_tokens)
        prefix = CounterMetricFamily("agentshare_prefix_tokens", "Prompt positions by role (decode: requests "
                                     "served here; prefill: for a request served elsewhere) and by where their "
                                     "KV came from", labels=["role", "source"])
        for role, source, v in (("decode", "computed", s.computed_prompt_tokens),
                                ("decode", "reused", s.reused_prompt_tokens),
                                ("decode", "imported", s.imported_prompt_tokens),
                                ("prefill", "computed", s.exported_prefill_tokens),
                                ("prefill", "reused", s.exported_cached_tokens)):
            prefix.add_metric([role, source], v)
        yield prefix
        yield CounterMetricFamily("agentshare_decode_tokens", "Tokens generated", value=s.decode_tokens)
        yield CounterMetricFamily("agentshare_split_prefix_tokens", "Prefix positions layer-split modules "
                                  "filled from the family's blocks, recomputing their top layers only",
                                  value=s.recomputed_prefix_tokens)
        yield CounterMetricFamily("agentshare_split_saved_layer_rows", "(position, layer) pairs those fills "
                                  "read from the family's blocks instead of computing", value=s.split_saved_layer_rows)
        blocks = CounterMetricFamily("agentshare_cache_blocks", "Prefix-cache lookups by outcome (blocks); "
                                     "cross_module_hit: served a block another module computed", labels=["outcome"])
        for outcome, v in (("hit", s.hit_blocks), ("miss", s.miss_blocks),
                           ("inflight_hit", s.inflight_hit_blocks), ("cross_module_hit", s.cross_module_hit_blocks)):
            blocks.add_metric([outcome], v)
        yield blocks
        yield CounterMetricFamily("agentshare_kv_evictions", "KV blocks evicted (LRU)", value=s.evictions)
        kv = GaugeMetricFamily("agentshare_kv_blocks", "KV pool blocks by state", labels=["state"])
        for state, v in (("free", s.blocks_free), ("held", s.blocks_held), ("evictable", s.blocks_evictable)):
            kv.add_metric([state], v)
        yield kv
        yield GaugeMetricFamily("agentshare_kv_blocks_capacity", "KV pool size (blocks)", value=s.blocks_capacity)
        yield GaugeMetricFamily("agentshare_kv_bytes_held", "KV bytes held by requests and pins", value=s.bytes_held)
        occupancy = s.blocks_held / s.blocks_capacity if s.blocks_capacity else 0.0
        yield GaugeMetricFamily("agentshare_kv_occupancy", "Fraction of KV blocks held", value=occupancy)
        yield GaugeMetricFamily("agentshare_requests_waiting", "Requests queued in the engine", value=s.waiting)
        yield GaugeMetricFamily("agentshare_requests_running", "Requests running in the engine", value=s.running)
        yield GaugeMetricFamily("agentshare_contexts_pinned", "Shared contexts pinned", value=s.contexts)


class Metrics:
    """The metrics of one app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        r = self.registry
        self.ttft = Histogram("agentshare_time_to_first_token_seconds", "Time to the first token",
                              ["agent"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("agentshare_inter_token_latency_seconds", "Time between tokens of a request",
                             ["agent"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("agentshare_e2e_request_latency_seconds", "Request latency, arrival to last token",
                             ["agent"], buckets=_REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("agentshare_request_queue_time_seconds", "Time a request waited in the engine "
                               "for admission (its KV reserved)", ["agent"], buckets=_REQUEST_BUCKETS, registry=r)
        self.transfer = Histogram("agentshare_kv_transfer_time_seconds", "Time a request's KV frames took on "
                                  "the link from the prefill worker", ["codec"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.requests = Counter("agentshare_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("agentshare_rejected_requests", "Requests refused with 429, by reason",
                                ["reason"], registry=r)

    def update(self, snapshot: EngineSnapshot) -> None:
        self._engine.snapshot = snapshot

    def render(self) -> bytes:
        return generate_latest(self.registry)
