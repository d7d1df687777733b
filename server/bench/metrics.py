"""What a load run reports, named and defined as ``vllm bench serve`` names and defines it.

Per request: TTFT (sent to first token), TPOT ((E2E - TTFT) / (output tokens - 1), requests of
two tokens or more), ITL (every gap between tokens, pooled over requests), E2E latency (sent to
last token; vLLM's ``e2el``): mean, median, p90, p95 and p99, in milliseconds. Throughput
(requests, output tokens, all tokens) is over the measured duration: from the start of the
measured phase to the last completion. Beyond vLLM's set:

- sessions: completion time (first request sent to last answer) of the sessions that finished;
- goodput per request (requests meeting every SLO given, per second) and per session (sessions
  every request of which met them);
- the cache hit ratio: ``cached_tokens`` over prompt tokens, of the requests that reported it;
- failures by kind (429, 5xx, 4xx, timeout, connection, stream): counted, never dropped;
- short answers: requests that returned fewer tokens than asked (``ignore_eos`` not honoured);
- steadiness, for capacity (:func:`sustained`): the rate sessions finished at against the rate
  they arrived at ((n - 1) over the span of their arrivals): the arrival rate divided by the
  slope of the sessions' ends on their starts (Theil-Sen: the median over every two sessions) (1 where the server keeps up,
  whatever each session's own length; above 1 behind a queue), and p95 TTFT of the requests sent
  in the first half of the arrivals against the second half.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from server.bench.client import RequestResult
from server.sim.metrics import Distribution

SLO_METRICS = ("ttft", "tpot", "e2el")
GROWTH_TOLERANCE = 1.25
"""p95 TTFT of the second half may be this much of the first half's and still count as not
growing (two halves of a short run differ by noise alone)."""
GROWTH_FLOOR_MS = 1000.0
"""... and a growth below this many milliseconds does not count either: at a light load, p95 of a
few dozen requests moves by hundreds of milliseconds with which prefills land in which half."""
MIN_HALF = 10
"""Requests each half needs before the growth test means anything."""


@dataclass(frozen=True)
class SessionResult:
    index: int
    start: float
    end: float
    ok: bool
    warmup: bool = False


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft:2000,tpot:200"`` (milliseconds; ttft, tpot, e2el) as a dict.

    >>> parse_slo("ttft:2000,tpot:200")
    {'ttft': 2000.0, 'tpot': 200.0}
    """
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition(":")
        name = name.strip().lower()
        if name not in SLO_METRICS:
            raise ValueError(f"SLO {part!r}: the metric is one of {', '.join(SLO_METRICS)} (e.g. ttft:2000)")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"SLO {part!r}: give milliseconds after the colon, e.g. ttft:2000") from None
        if out[name] <= 0:
            raise ValueError(f"SLO {part!r}: milliseconds must be positive")
    return out


def _ms(dist: Distribution, name: str) -> dict[str, float]:
    return {f"mean_{name}_ms": dist.mean * 1e3, f"median_{name}_ms": dist.p50 * 1e3,
            f"p90_{name}_ms": dist.p90 * 1e3, f"p95_{name}_ms": dist.p95 * 1e3, f"p99_{name}_ms": dist.p99 * 1e3}


def _seconds(dist: Distribution, name: str) -> dict[str, float]:
    return {f"mean_{name}_s": dist.mean, f"median_{name}_s": dist.p50, f"p90_{name}_s": dist.p90,
            f"p95_{name}_s": dist.p95, f"p99_{name}_s": dist.p99}


def meets(r: RequestResult, slo: Mapping[str, float]) -> bool:
    """Whether a finished request met every SLO (milliseconds)."""
    if not r.ok:
        return False
    tpot = r.tpot
    got = {"ttft": r.ttft * 1e3, "e2el": r.e2e * 1e3, "tpot": tpot * 1e3 if tpot is not None else 0.0}
    return all(got[k] <= v for k, v in slo.items())


def summarize(results: Sequence[RequestResult], sessions: Sequence[SessionResult], *, t0: float,
              last_arrival: float, slo: Mapping[str, float] | None = None,
              offered_rate: float | None = None) -> dict[str, Any]:
    """The run's figures; warm-up requests and sessions are left out. ``t0``: the measured
    phase's start (``perf_counter``); ``last_arrival``: seconds after ``t0`` of the last session
    started; ``offered_rate``: sessions per second offered (open loop)."""
    slo = dict(slo or {})
    measured = [r for r in results if not r.warmup]
    ok = [r for r in measured if r.ok]
    runs = [s for s in sessions if not s.warmup]
    ends = [r.done for r in ok if r.done is not None] + [s.end for s in runs]
    duration = (max(ends) - t0) if ends else 0.0
    span = duration if duration > 0 else math.nan
    prompt = sum(r.prompt_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    done_sessions = [s for s in runs if s.ok]
    good = [r for r in ok if meets(r, slo)]
    good_ids = {id(r) for r in good}
    by_session: dict[int, list[RequestResult]] = {}
    for r in measured:
        by_session.setdefault(r.session, []).append(r)
    good_sessions = [s for s in done_sessions if all(id(r) in good_ids for r in by_session.get(s.index, []))]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    summary: dict[str, Any] = {
        "requests": len(measured), "completed": len(ok), "failed": len(measured) - len(ok),
        "failures": dict(Counter(r.failure or "error" for r in measured if not r.ok)),
        "errors": [r.error for r in measured if not r.ok][:10],
        "short_answers": sum(1 for r in ok if r.completion_tokens < r.max_tokens),
        "sessions": len(runs), "sessions_completed": len(done_sessions),
        "duration_s": duration,
        "request_throughput": len(ok) / span, "output_throughput": out_tokens / span,
        "total_token_throughput": (prompt + out_tokens) / span,
        "prompt_tokens": prompt, "completion_tokens": out_tokens,
        **_ms(Distribution.of([r.ttft for r in ok]), "ttft"),
        **_ms(Distribution.of(tpots), "tpot"),
        **_ms(Distribution.of([x for r in ok for x in r.itl]), "itl"),
        **_ms(Distribution.of([r.e2e for r in ok]), "e2el"),
        **_seconds(Distribution.of([s.end - s.start for s in done_sessions]), "session"),
        "cache_hit_ratio": (sum(r.cached_tokens or 0 for r in reported) / max(1, sum(r.prompt_tokens for r in reported))
                            if reported else None),
        "slo_ms": slo,
        "request_goodput": len(good) / span if slo else None,
        "session_goodput": len(good_sessions) / span if slo else None,
    }
    summary |= steadiness(ok, runs, t0=t0, last_arrival=last_arrival, offered_rate=offered_rate)
    return summary


def steadiness(ok: Sequence[RequestResult], sessions: Sequence[SessionResult], *, t0: float, last_arrival: float,
               offered_rate: float | None) -> dict[str, Any]:
    """The figures :func:`sustained` reads (see the module's docstring)."""
    out: dict[str, Any] = {"offered_session_rate": offered_rate, "last_arrival_s": last_arrival}
    starts = sorted(s.start for s in sessions)
    done = [(s.start, s.end) for s in sessions if s.ok]
    # n sessions arrived over a span A: (n - 1) / A per second. Where the server keeps up, each
    # ends its own length after it began, whatever that length: the ends follow the starts with
    # slope 1. Behind a queue, the ends spread out at the rate the server manages: the slope of
    # ends on starts (Theil-Sen, so one long session moves it little) divides the rate.
    arrival_span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
    out["arrival_rate"] = (len(starts) - 1) / arrival_span if arrival_span > 0 else None
    out["completion_slope"] = _slope(done) if len(done) > 2 else None
    out["achieved_session_rate"] = (out["arrival_rate"] / out["completion_slope"]
                                    if out["arrival_rate"] and out["completion_slope"] else None)
    mid = t0 + last_arrival / 2
    first = [r.ttft for r in ok if r.sent <= mid]
    second = [r.ttft for r in ok if r.sent > mid]
    out["p95_ttft_first_half_ms"] = Distribution.of(first).p95 * 1e3
    out["p95_ttft_second_half_ms"] = Distribution.of(second).p95 * 1e3
    out["half_sizes"] = [len(first), len(second)]
    return out


def _slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Theil-Sen: the median of the slopes between every two points (one outlier barely moves it)."""
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(points, 2) if x2 != x1]
    return statistics.median(slopes) if slopes else None


def sustained(summary: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether a run held its offered rate: no failed request, the achieved session rate at
    least 95 % of the rate sessions arrived at (the offered rate, as this run's Poisson draws
    gave it), and p95 TTFT not growing from the first half of the run to the second (within
    :data:`GROWTH_TOLERANCE` or :data:`GROWTH_FLOOR_MS`). Returns the verdict and why."""
    if not summary.get("offered_session_rate"):
        return False, "closed loop: no offered rate"
    if summary["failed"]:
        return False, f"{summary['failed']} requests failed"
    offered, achieved = summary.get("arrival_rate"), summary.get("achieved_session_rate")
    if offered is None or achieved is None:
        return False, "fewer than two sessions arrived or finished: run longer"
    if achieved < 0.95 * offered:
        return False, f"achieved {achieved:.3f} sessions/s of {offered:.3f} offered"
    n1, n2 = summary["half_sizes"]
    if min(n1, n2) < MIN_HALF:
        return False, f"too few requests per half ({n1}, {n2}) to tell whether TTFT grows: run longer"
    a, b = summary["p95_ttft_first_half_ms"], summary["p95_ttft_second_half_ms"]
    if b > GROWTH_TOLERANCE * a and b - a > GROWTH_FLOOR_MS:
        return False, f"p95 TTFT grew from {a:.0f} ms to {b:.0f} ms"
    return True, f"achieved {achieved:.3f} of {offered:.3f} sessions/s; p95 TTFT {a:.0f} -> {b:.0f} ms"
