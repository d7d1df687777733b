"""A load sweep's table, its capacity, and its plots (p95 TTFT and throughput against the
offered rate, one line per arm)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Result = Mapping[str, Any]
"""What :func:`server.bench.run.bench` returns (and ``--json`` writes)."""


def capacity(runs: Sequence[Mapping[str, Any]]) -> float | None:
    """The highest offered session rate the arm sustained, every lower rate tried sustained too
    (:func:`server.bench.metrics.sustained`); None when it sustained none (or ran closed loop).

    >>> capacity([{"load": {"session_rate": r}, "sustained": [ok, ""]} for r, ok in ((1, True), (2, True), (4, False))])
    2
    """
    best = None
    for run in sorted((r for r in runs if r["load"].get("session_rate")), key=lambda r: r["load"]["session_rate"]):
        if not run["sustained"][0]:
            break
        best = run["load"]["session_rate"]
    return best


def profile(run: Mapping[str, Any]) -> dict[str, Any]:
    """Where a run's time went, from the client's figures and the server's counters (agentshare's
    or vLLM's names): queueing, prefill (tokens computed against served from cache), decode
    (TPOT, the batch), and eviction. Figures the server does not expose are None.

    >>> run = {"summary": {"median_ttft_ms": 900.0, "median_tpot_ms": 40.0},
    ...        "server": {"counters": {'agentshare_request_queue_time_seconds_sum{agent="a"}': 2.0,
    ...                                'agentshare_request_queue_time_seconds_sum{agent="b"}': 4.0,
    ...                                "agentshare_request_queue_time_seconds_count": 12.0,
    ...                                "agentshare_kv_evictions_total": 7.0},
    ...                   "gauges": {"agentshare_requests_running": {"mean": 3.5, "max": 6.0}}}}
    >>> p = profile(run); p["mean_queue_ms"], p["evicted_blocks"], p["mean_running"], p["prefill_computed_tokens"]
    (500.0, 7.0, 3.5, None)
    """
    c = run.get("server", {}).get("counters", {})
    g = run.get("server", {}).get("gauges", {})

    def first(d: Mapping[str, Any], *keys: str) -> Any:
        return next((d[k] for k in keys if k in d), None)

    def total(d: Mapping[str, Any], *names: str) -> Any:
        """A metric summed over its labels (the first of ``names`` the server has)."""
        for name in names:
            hits = [v for k, v in d.items() if k == name or k.startswith(name + "{")]
            if hits:
                return sum(hits)
        return None

    q_sum = total(c, "agentshare_request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_sum")
    q_n = total(c, "agentshare_request_queue_time_seconds_count", "vllm:request_queue_time_seconds_count")
    running = first(g, "agentshare_requests_running", "vllm:num_requests_running")
    waiting = first(g, "agentshare_requests_waiting", "vllm:num_requests_waiting")
    s = run.get("summary", {})
    return {
        "median_ttft_ms": s.get("median_ttft_ms"), "median_tpot_ms": s.get("median_tpot_ms"),
        "mean_queue_ms": 1e3 * q_sum / q_n if q_sum is not None and q_n else None,
        "prefill_computed_tokens": first(c, 'agentshare_prefill_tokens_total{source="computed"}'),
        "prefill_cached_tokens": first(c, 'agentshare_prefill_tokens_total{source="cached"}'),
        "evicted_blocks": first(c, "agentshare_kv_evictions_total"),
        "preemptions": first(c, "vllm:num_preemptions_total"),
        "mean_running": running["mean"] if running else None, "max_waiting": waiting["max"] if waiting else None,
        "mean_kv_occupancy": (first(g, "agentshare_kv_occupancy", "vllm:kv_cache_usage_perc") or {}).get("mean"),
    }


def _f(x: Any, spec: str = ".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(result: Result) -> str:
    """One line per load: what a person reads first."""
    head = (f"{'load':>16} {'done':>9} {'req/s':>6} {'tok/s':>6} {'TTFT p50':>9} {'p95':>7} {'p99':>7} "
            f"{'TPOT p50':>9} {'E2E p95':>8} {'sess p95':>9} {'hit':>5} {'goodput':>8}  sustained")
    lines = [head]
    for run in result["runs"]:
        s, load = run["summary"], run["load"]
        label = f"rate {load['session_rate']:g}/s" if load["mode"] == "open" else f"conc {load['concurrency']}"
        hit = s["cache_hit_ratio"]
        held = ("-" if load["mode"] != "open" else
                f"{'yes' if run['sustained'][0] else 'no'}: {run['sustained'][1]}")
        lines.append(
            f"{label:>16} {s['completed']:>4}/{s['requests']:<4} {_f(s['request_throughput'], '.2f'):>6} "
            f"{_f(s['output_throughput'], '.1f'):>6} {_f(s['median_ttft_ms']):>7}ms {_f(s['p95_ttft_ms']):>5}ms "
            f"{_f(s['p99_ttft_ms']):>5}ms {_f(s['median_tpot_ms']):>7}ms {_f(s['p95_e2el_ms']):>6}ms "
            f"{_f(s['p95_session_s'], '.1f'):>8}s {_f(hit * 100 if hit is not None else None):>4}% "
            f"{_f(s['request_goodput'], '.2f'):>8}  {held}")
        if s["failed"]:
            lines.append(f"{'':>16} failed: {s['failures']}; first: {s['errors'][:1]}")
        if s["short_answers"]:
            lines.append(f"{'':>16} {s['short_answers']} answers were shorter than asked (ignore_eos not honoured?)")
    if (cap := result.get("capacity")) is not None:
        lines.append(f"capacity: {cap:g} sessions/s")
    return "\n".join(lines)


def jsonable(value: Any) -> Any:
    """``value`` with NaN (a figure of no sample) as None, so that the JSON is standard.

    >>> jsonable({"p95": float("nan"), "runs": [1.5]})
    {'p95': None, 'runs': [1.5]}
    """
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Mapping):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def plot(arms: Mapping[str, Result], path: Path | str, *, title: str = "") -> Path:
    """p95 TTFT and output throughput against the offered session rate, one line per arm; written
    to ``path`` (its suffix picks the format: .png, .svg, ...). Needs matplotlib (the ``bench``
    extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'agentshare[bench]'") from None
    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(10, 4))
    for name, result in arms.items():
        runs = sorted((r for r in result["runs"] if r["load"]["mode"] == "open"),
                      key=lambda r: r["load"]["session_rate"])
        if not runs:
            continue
        rates = [r["load"]["session_rate"] for r in runs]
        ax_ttft.plot(rates, [r["summary"]["p95_ttft_ms"] / 1e3 for r in runs], marker="o", label=name)
        ax_tput.plot(rates, [r["summary"]["output_throughput"] for r in runs], marker="o", label=name)
    ax_ttft.set(xlabel="offered sessions per second", ylabel="p95 TTFT (s)", yscale="log", title="p95 TTFT")
    ax_tput.set(xlabel="offered sessions per second", ylabel="output tokens per second", title="throughput")
    for ax in (ax_ttft, ax_tput):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
