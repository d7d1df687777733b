"""A preview of the Grafana dashboard without Grafana: a real workload on a real server, its
``/metrics`` scraped every second, the dashboard's main panels computed from the scrapes as the
dashboard's PromQL computes them (rates over a window, ``histogram_quantile`` over bucket rates)
and drawn with matplotlib (``pip install -e '.[bench]'``).

    python examples/observability/render.py                      # launches a local server (default model)
    python examples/observability/render.py --url http://127.0.0.1:8000 --seconds 60

The workload: rounds of three agents over one shared context (sections of the demo's incident
report; a new section every other round, so some prompt tokens are computed and most are read
from the pool). The windows are shorter than the dashboard's 1 minute (``--window``, 10 s by
default), for a run of under a minute.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import httpx

from agentshare import Agent, AsyncClient, Sampling
from agentshare.metrics import Labels, parse_prometheus

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "data" / "incident-report.md"
OUT = HERE.parents[1] / "docs" / "img" / "dashboard-preview.png"
AGENTS = (("retrieval", "Quote the report's sentence that answers: what went wrong first?"),
          ("planning", "List the next two steps, one line each."),
          ("coding", "Write one line of Python that would have prevented this."))
Scrape = dict[tuple[str, Labels], float]


def total(s: Scrape, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (values may be a|b)."""
    return sum(v for (n, ls), v in s.items() if n == name
               and all(dict(ls).get(k) in want.split("|") for k, want in labels.items()))


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile over ``(le, cumulative count)`` pairs (sorted, +Inf last).

    >>> histogram_quantile(0.5, [(0.1, 0.0), (0.2, 4.0), (math.inf, 4.0)])
    0.15
    """
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # in the +Inf bucket: the highest finite bound, as Prometheus does
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count) if count > prev_count \
                else le
        prev_le, prev_count = le, count
    return math.nan


def bucket_deltas(new: Scrape, old: Scrape, metric: str) -> list[tuple[float, float]]:
    """``sum by (le) (increase(metric_bucket[window]))`` between two scrapes."""
    les: dict[float, float] = {}
    for (n, ls), v in new.items():
        if n == f"{metric}_bucket":
            le = float(dict(ls)["le"])
            les[le] = les.get(le, 0.0) + v - old.get((n, ls), 0.0)
    return sorted(les.items())


async def workload(url: str, seconds: float, max_tokens: int) -> int:
    document = DOC.read_text()
    sections = document.split("\n## ")
    agents = [Agent(name, instruction=text, sampling=Sampling(max_tokens=max_tokens, temperature=0))
              for name, text in AGENTS]
    rounds, deadline = 0, time.monotonic() + seconds
    async with AsyncClient(url) as client:
        while time.monotonic() < deadline:
            # the header and the first sections, one more section every other round: part new, part shared
            n = 2 + rounds // 2
            context = "\n## ".join(sections[: min(n, len(sections))])
            async with await client.context(context) as ctx:
                await ctx.fork(agents)
            rounds += 1
            await anyio.sleep(0.5)
    return rounds


async def scraper(url: str, interval: float, out: list[tuple[float, Scrape]], stop: anyio.Event) -> None:
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            r = await http.get(f"{url}/metrics")
            r.raise_for_status()
            out.append((time.monotonic() - start, parse_prometheus(r.text)))
            if stop.is_set():
                return
            await anyio.sleep(interval)


def panels(scrapes: list[tuple[float, Scrape]], window: float) -> dict[str, list[tuple[float, float]]]:
    """The dashboard's quantities at each scrape, over ``window`` seconds (``[1m]`` in Grafana)."""
    series: dict[str, list[tuple[float, float]]] = {}

    def put(key: str, t: float, v: float) -> None:
        series.setdefault(key, []).append((t, v))

    first = scrapes[0][1]
    for i, (t, s) in enumerate(scrapes):
        j = max((k for k in range(i + 1) if scrapes[k][0] <= t - window), default=0)
        old = scrapes[j][1]
        prompt = total(s, "agentshare_prompt_tokens_total") - total(old, "agentshare_prompt_tokens_total")
        saved = (total(s, "agentshare_prefix_tokens_total", role="decode", source="reused|imported")
                 - total(old, "agentshare_prefix_tokens_total", role="decode", source="reused|imported"))
        put("sharing ratio", t, saved / prompt if prompt else math.nan)
        run_prompt = total(s, "agentshare_prompt_tokens_total") - total(first, "agentshare_prompt_tokens_total")
        for source in ("computed", "reused", "imported"):
            put(source, t, total(s, "agentshare_prefix_tokens_total", role="decode", source=source)
                - total(first, "agentshare_prefix_tokens_total", role="decode", source=source))
        run_saved = series["reused"][-1][1] + series["imported"][-1][1]
        put("sharing ratio (run)", t, run_saved / run_prompt if run_prompt else math.nan)
        for metric, key in (("agentshare_time_to_first_token_seconds", "ttft"),
                            ("agentshare_inter_token_latency_seconds", "itl")):
            deltas = bucket_deltas(s, old, metric)
            for q in (0.5, 0.9, 0.99):
                put(f"{key} p{round(q * 100)}", t, histogram_quantile(q, deltas))
        put("occupancy", t, total(s, "agentshare_kv_occupancy"))
        put("running", t, total(s, "agentshare_requests_running"))
        put("waiting", t, total(s, "agentshare_requests_waiting"))
    return series


def run_quantiles(scrapes: list[tuple[float, Scrape]], metric: str) -> tuple[float, float, float]:
    deltas = bucket_deltas(scrapes[-1][1], scrapes[0][1], metric)
    return (histogram_quantile(0.5, deltas), histogram_quantile(0.9, deltas), histogram_quantile(0.99, deltas))


def draw(series: dict[str, list[tuple[float, float]]], out: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def xs(key: str) -> list[float]:
        return [t for t, _ in series[key]]

    def ys(key: str) -> list[float]:
        return [v for _, v in series[key]]

    fig, axes = plt.subplots(3, 2, figsize=(12, 9.5))
    fig.suptitle("agentshare dashboard: PREVIEW drawn with matplotlib from the same /metrics (not Grafana)",
                 fontsize=13, fontweight="bold")
    fig.text(0.5, 0.925, "\n".join(textwrap.wrap(subtitle, 150)), ha="center", fontsize=9, color="#444")
    ax = axes[0][0]
    ax.plot(xs("sharing ratio"), ys("sharing ratio"), label="window")
    ax.plot(xs("sharing ratio (run)"), ys("sharing ratio (run)"), label="whole run", linestyle="--")
    ax.set(title="Sharing ratio: (reused + imported) / prompt tokens", ylim=(0, 1))
    ax = axes[0][1]
    ax.stackplot(xs("computed"), ys("computed"), ys("reused"), ys("imported"),
                 labels=["computed", "reused (saved)", "imported (saved)"], alpha=0.7)
    ax.set(title="Prompt tokens by source (cumulative): prefill saved")
    for ax, key, title in ((axes[1][0], "ttft", "Time to first token, s"),
                           (axes[1][1], "itl", "Inter-token latency, s")):
        for q in ("p50", "p90", "p99"):
            ax.plot(xs(f"{key} {q}"), ys(f"{key} {q}"), marker=".", label=q)
        ax.set(title=f"{title} (histogram_quantile of bucket rates)")
    ax = axes[2][0]
    ax.plot(xs("occupancy"), [100 * v for v in ys("occupancy")], color="tab:orange", label="held")
    ax.set(title="KV pool occupancy, % of blocks held", ylim=(0, max(5.0, 120 * max(ys("occupancy")))))
    ax = axes[2][1]
    ax.step(xs("running"), ys("running"), where="post", label="running")
    ax.step(xs("waiting"), ys("waiting"), where="post", label="waiting")
    ax.set(title="Requests running / waiting")
    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
            ax.legend(loc="upper left", fontsize=8)
            ax.set_xlabel("seconds", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)


async def main(args: argparse.Namespace) -> int:
    client = AsyncClient(args.url) if args.url else AsyncClient(
        model=args.model, dtype=args.dtype, server_args=["--log-level", "warning"])
    async with client:
        url = client.base_url
        assert url is not None
        print(f"server {url}; warming up ...", file=sys.stderr)
        async with await client.context("A short warm-up note.") as ctx:  # torch's first-call costs
            await ctx.fork([Agent("warm", instruction="Say hi.", sampling=Sampling(max_tokens=2))])
        scrapes: list[tuple[float, Scrape]] = []
        stop = anyio.Event()
        rounds = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(scraper, url, args.interval, scrapes, stop)
            rounds = await workload(url, args.seconds, args.max_tokens)
            await anyio.sleep(args.interval)
            stop.set()
    series = panels(scrapes, args.window)
    first, last = scrapes[0][1], scrapes[-1][1]
    prompt = total(last, "agentshare_prompt_tokens_total") - total(first, "agentshare_prompt_tokens_total")
    saved = (total(last, "agentshare_prefix_tokens_total", role="decode", source="reused|imported")
             - total(first, "agentshare_prefix_tokens_total", role="decode", source="reused|imported"))
    ttft = run_quantiles(scrapes, "agentshare_time_to_first_token_seconds")
    itl = run_quantiles(scrapes, "agentshare_inter_token_latency_seconds")
    occupancy = max(v for _, v in series["occupancy"])
    summary = (f"{rounds} rounds of 3 agents, {len(scrapes)} scrapes every {args.interval:g} s, windows of "
               f"{args.window:g} s; run: prompt {prompt:,.0f} tokens, saved {saved:,.0f} ({saved / prompt:.0%}), "
               f"TTFT p50/p90 {ttft[0]:.3f}/{ttft[1]:.3f} s, ITL p50/p90 {itl[0]:.3f}/{itl[1]:.3f} s, "
               f"max KV occupancy {occupancy:.1%}")
    print(summary)
    draw(series, Path(args.out), summary)
    print(f"wrote {args.out}")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--url", help="a running server (default: launch one)")
    p.add_argument("--model", help="base model directory for the launched server (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seconds", type=float, default=40.0, help="how long the workload runs")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    p.add_argument("--window", type=float, default=10.0, help="rate window, seconds (the dashboard's: 60)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=str(OUT))
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(anyio.run(main, parse_args()))
