"""What a simulated run reports, defined as ``vllm bench serve`` defines it (docs/design.md §7).

Per request: TTFT = first token - arrival; E2E = last token - arrival; TPOT = (E2E - TTFT) /
(output tokens - 1) for requests with more than one output token. Throughput is over the span
from the first arrival to the last completion. Beyond vLLM's set: prefix hit ratio (prompt
tokens the prefill site did not compute / prompt tokens), cross-module hit tokens (served from
blocks another module computed), KV bytes moved over links, and a count per decision reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)
class RequestRecord:
    """One request's life. Times are simulated seconds."""

    id: int
    module: str
    arrival: float
    input_tokens: int
    output_tokens: int
    decode_worker: int = -1
    where: str = ""
    reason: str = ""
    compute_tokens: int = 0
    cached_tokens: int = 0
    cross_module_tokens: int = 0
    transfer_bytes: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    """Blocks of the prompt found in the prefill site's cache (the trace's hit unit)."""
    first_token: float | None = None
    finish: float | None = None

    @property
    def ttft(self) -> float:
        assert self.first_token is not None, f"request {self.id} has no first token"
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        assert self.finish is not None, f"request {self.id} did not finish"
        return self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(*(float("nan"),) * 5)
        arr = np.asarray(values, dtype=float)
        p = np.percentile(arr, PERCENTILES)
        return cls(float(arr.mean()), *(float(x) for x in p))


@dataclass(frozen=True, slots=True)
class Summary:
    """The run's report. Percentiles of seconds; throughput per second of simulated time."""

    completed: int
    duration_s: float
    ttft: Distribution
    e2e: Distribution
    tpot: Distribution
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    hit_ratio: float
    block_hit_ratio: float
    cross_module_hit_ratio: float
    kv_bytes_moved: int
    offloaded: int
    reasons: dict[str, int] = field(default_factory=dict)

    def row(self) -> dict[str, float | int]:
        """A flat dict for tables and JSON."""
        return {
            "completed": self.completed,
            "ttft_mean": self.ttft.mean, "ttft_p50": self.ttft.p50, "ttft_p90": self.ttft.p90,
            "ttft_p95": self.ttft.p95, "ttft_p99": self.ttft.p99,
            "e2e_mean": self.e2e.mean, "e2e_p50": self.e2e.p50, "e2e_p90": self.e2e.p90,
            "e2e_p95": self.e2e.p95, "e2e_p99": self.e2e.p99,
            "tpot_mean": self.tpot.mean, "tpot_p50": self.tpot.p50,
            "req_s": self.request_throughput, "out_tok_s": self.output_throughput,
            "tok_s": self.total_token_throughput,
            "hit_ratio": self.hit_ratio, "block_hit_ratio": self.block_hit_ratio, "cross_module_hit_ratio": self.cross_module_hit_ratio,
            "kv_gb_moved": self.kv_bytes_moved / 1e9, "offloaded": self.offloaded,
        }


def summarize(records: Sequence[RequestRecord]) -> Summary:
    """Aggregate finished requests.

    >>> r = RequestRecord(0, "m", arrival=0.0, input_tokens=100, output_tokens=3,
    ...                   cached_tokens=25, first_token=1.0, finish=2.0)
    >>> s = summarize([r]); s.ttft.p50, s.tpot.mean, s.hit_ratio, s.output_throughput
    (1.0, 0.5, 0.25, 1.5)
    """
    done = [r for r in records if r.finish is not None]
    if not done:
        nan = Distribution.of([])
        return Summary(0, 0.0, nan, nan, nan, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    start = min(r.arrival for r in done)
    duration = max(r.finish for r in done if r.finish is not None) - start
    span = duration if duration > 0 else float("nan")
    prompt = sum(r.input_tokens for r in done)
    out = sum(r.output_tokens for r in done)
    tpots = [t for r in done if (t := r.tpot) is not None]
    return Summary(
        completed=len(done),
        duration_s=duration,
        ttft=Distribution.of([r.ttft for r in done]),
        e2e=Distribution.of([r.e2e for r in done]),
        tpot=Distribution.of(tpots),
        request_throughput=len(done) / span,
        output_throughput=out / span,
        total_token_throughput=(prompt + out) / span,
        hit_ratio=sum(r.cached_tokens for r in done) / prompt,
        block_hit_ratio=sum(r.hit_blocks for r in done) / max(1, sum(r.blocks for r in done)),
        cross_module_hit_ratio=sum(r.cross_module_tokens for r in done) / prompt,
        kv_bytes_moved=sum(r.transfer_bytes for r in done),
        offloaded=sum(1 for r in done if r.where == "remote"),
        reasons=dict(Counter(r.reason for r in done)),
    )
