"""RouteDecision experiments in the cluster simulator (issue 8): threshold, bandwidth, P:D ratio, sharing.

Two clusters:

- ``cpu``: 1 prefill + 3 decode workers with the measured SmolLM2-135M profile (docs/design.md §5),
  1 Gbit/s links, the Mooncake trace scaled down 16x (32-token blocks, first ``--cpu-limit``
  requests);
- ``gpu``: 2 prefill (H100-class, 20k tok/s, 512 GiB HBM+DRAM KV store) + 6 decode (H20-class,
  3k tok/s local prefill) workers, Llama-3.1-8B KV (128 KiB/token), 100 Gbit/s links, the whole
  trace at its own timestamps. Every GPU number is an assumption (see server/sim/profile.py).

Experiments per cluster:

1. offload-threshold sweep, bandwidth-blind and bandwidth-aware;
2. bandwidth sweep: local only / naive offload-everything / selective (best threshold of 1) /
   selective + bandwidth-aware;
3. prefill:decode worker ratio at a fixed worker count;
4. cross-module sharing on/off as concurrent multi-agent sessions grow.

Usage::

    python benchmarks/sim_experiments.py [--json results/sim.json] [--plots docs/img] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from server.kv.trace import load_trace
from server.policy import OffloadPolicy
from server.sim import (
    CPU_SMOLLM2_135M,
    GPU_LLAMA8B_H20,
    GPU_LLAMA8B_H100,
    ClusterConfig,
    MultiAgentWorkload,
    SimRequest,
    Simulator,
    from_trace,
)

Row = dict[str, Any]
GBIT = 1e9 / 8


@dataclass(frozen=True)
class Setup:
    name: str
    base: ClusterConfig
    trace: Callable[[], list[SimRequest]]
    thresholds: Sequence[int | None]
    bandwidths_gbit: Sequence[float]
    workers: int
    agents: Callable[[int], MultiAgentWorkload]
    sessions: Sequence[int]
    sharing_cache_tokens: int | None
    max_link_wait_s: float


def cpu_setup(limit: int) -> Setup:
    return Setup(
        name="cpu",
        base=ClusterConfig(prefill_workers=1, decode_workers=3, prefill_profile=CPU_SMOLLM2_135M,
                           link_bandwidth_bytes_s=1 * GBIT, link_latency_s=0.0005, block_tokens=32),
        trace=lambda: from_trace(load_trace(limit=limit), token_scale=16),
        thresholds=(0, 128, 256, 512, 768, 1024, 1536, 2048, 4096, None),
        bandwidths_gbit=(0.01, 0.1, 0.3, 1.0, 10.0),
        workers=4,
        agents=lambda s: MultiAgentWorkload(
            sessions=s, agents=4, rounds=4, context_tokens=2048, turn_tokens=64,
            growth_tokens=256, output_tokens=16, round_interval_s=60.0,
            session_interval_s=60.0 / s, block_tokens=32),
        sessions=(1, 2, 4, 8, 16, 24),
        sharing_cache_tokens=64 * 1024,
        max_link_wait_s=1.0,
    )


def gpu_setup(limit: int | None) -> Setup:
    prefill = replace(GPU_LLAMA8B_H100, kv_capacity_bytes=512 * 2**30)
    return Setup(
        name="gpu",
        base=ClusterConfig(prefill_workers=2, decode_workers=6, prefill_profile=prefill,
                           decode_profile=GPU_LLAMA8B_H20, link_bandwidth_bytes_s=100 * GBIT,
                           link_latency_s=0.0005, block_tokens=512),
        trace=lambda: from_trace(load_trace(limit=limit)),
        thresholds=(0, 1024, 2048, 4096, 8192, 16384, 32768, None),
        bandwidths_gbit=(10.0, 25.0, 50.0, 100.0, 400.0),
        workers=8,
        agents=lambda s: MultiAgentWorkload(
            sessions=s, agents=4, rounds=4, context_tokens=8192, turn_tokens=256,
            growth_tokens=1024, output_tokens=64, round_interval_s=20.0,
            session_interval_s=20.0 / s, block_tokens=256),
        sessions=(8, 32, 64, 128, 192, 256),
        sharing_cache_tokens=None,
        max_link_wait_s=5.0,  # a local 8k-token prefill on the H20-class side takes ~3 s
    )


def run(cfg: ClusterConfig, reqs: list[SimRequest], **labels: Any) -> Row:
    res = Simulator(cfg).run(reqs)
    row: Row = dict(labels)
    row.update(res.summary.row())
    row["offloaded_pct"] = 100.0 * res.summary.offloaded / max(1, res.summary.completed)
    row["wall_s"] = res.wall_s
    row["reasons"] = res.reasons
    return row


def arms(threshold: int, wait: float) -> dict[str, OffloadPolicy]:
    return {
        "local-only": OffloadPolicy(threshold_tokens=None),
        "naive-all": OffloadPolicy(threshold_tokens=0, bandwidth_aware=False),
        f"selective-{threshold}": OffloadPolicy(threshold_tokens=threshold, bandwidth_aware=False),
        f"selective-{threshold}+bw": OffloadPolicy(
            threshold_tokens=threshold, bandwidth_aware=True, max_link_wait_s=wait),
        f"selective-{threshold}+bw+queues": OffloadPolicy(
            threshold_tokens=threshold, bandwidth_aware=True, max_link_wait_s=wait,
            balance_queues=True),
    }


def threshold_sweep(s: Setup, reqs: list[SimRequest]) -> list[Row]:
    rows = []
    for aware in (False, True):
        for t in s.thresholds:
            pol = OffloadPolicy(threshold_tokens=t, bandwidth_aware=aware,
                                max_link_wait_s=s.max_link_wait_s)
            cfg = replace(s.base, policy=pol)
            rows.append(run(cfg, reqs, threshold="never" if t is None else t, bw_aware=aware))
    return rows


def naive_vs_selective(rows: list[Row], t: int) -> str:
    """One line: how offloading everything compares with the best selective threshold."""
    by = {r["arm"]: r for r in rows}
    naive, sel = by["naive-all"], by[f"selective-{t}"]
    return (f"naive/selective p90 TTFT = {naive['ttft_p90'] / sel['ttft_p90']:.2f}x, "
            f"KV moved {naive['kv_gb_moved']:.0f} vs {sel['kv_gb_moved']:.0f} GB")


def best_threshold(rows: list[Row]) -> int:
    """The finite, non-zero, bandwidth-blind threshold with the lowest p90 TTFT."""
    finite = [r for r in rows if not r["bw_aware"] and r["threshold"] not in ("never", 0)]
    return int(min(finite, key=lambda r: r["ttft_p90"])["threshold"])


def bandwidth_sweep(s: Setup, reqs: list[SimRequest], t: int) -> list[Row]:
    rows = []
    for gbit in s.bandwidths_gbit:
        for arm, pol in arms(t, s.max_link_wait_s).items():
            cfg = replace(s.base, link_bandwidth_bytes_s=gbit * GBIT, policy=pol)
            rows.append(run(cfg, reqs, gbit=gbit, arm=arm))
    return rows


def ratio_sweep(s: Setup, reqs: list[SimRequest], t: int) -> list[Row]:
    rows = []
    for p in range(0, s.workers):
        pol = OffloadPolicy(threshold_tokens=t if p else None, bandwidth_aware=True,
                            max_link_wait_s=s.max_link_wait_s)
        cfg = replace(s.base, prefill_workers=p, decode_workers=s.workers - p, policy=pol)
        rows.append(run(cfg, reqs, ratio=f"{p}:{s.workers - p}"))
    return rows


def sharing_sweep(s: Setup, t: int) -> list[Row]:
    rows = []
    for n in s.sessions:
        reqs = s.agents(n).requests()
        for sharing in (True, False):
            cfg = replace(s.base, cross_module_sharing=sharing, cache_tokens=s.sharing_cache_tokens,
                          policy=OffloadPolicy(threshold_tokens=t, bandwidth_aware=True,
                                               max_link_wait_s=s.max_link_wait_s))
            rows.append(run(cfg, reqs, sessions=n, sharing="on" if sharing else "off"))
    return rows


COLS = ["ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50", "e2e_p90", "tpot_p50", "req_s",
        "hit_ratio", "offloaded_pct", "kv_gb_moved"]


def table(title: str, rows: list[Row], keys: Sequence[str], cols: Sequence[str] = COLS) -> str:
    head = [*keys, *cols]
    lines = [f"\n### {title}\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r[k]) for k in head) + " |")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def plot(results: dict[str, dict[str, list[Row]]], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (the tables above carry the data)")
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4))
    for ax, (name, res) in zip(axes, results.items(), strict=True):
        for aware in (False, True):
            pts = [r for r in res["threshold"] if r["bw_aware"] == aware and r["threshold"] != "never"]
            ax.plot([max(r["threshold"], 1) for r in pts], [r["ttft_p90"] for r in pts], "o-",
                    label="bandwidth-aware" if aware else "threshold only")
        never = next(r for r in res["threshold"] if r["threshold"] == "never")
        ax.axhline(never["ttft_p90"], ls="--", c="gray", label="never offload")
        ax.set(xscale="log", yscale="log", xlabel="offload threshold (tokens; 0 plotted at 1)",
               ylabel="p90 TTFT (s)", title=f"{name}: threshold sweep")
        ax.legend()
    paths.append(_save(fig, out / "sim_threshold.png"))
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4))
    for ax, (name, res) in zip(axes, results.items(), strict=True):
        for arm in dict.fromkeys(r["arm"] for r in res["bandwidth"]):
            pts = [r for r in res["bandwidth"] if r["arm"] == arm]
            ax.plot([r["gbit"] for r in pts], [r["ttft_p90"] for r in pts], "o-", label=arm)
        ax.set(xscale="log", yscale="log", xlabel="link bandwidth (Gbit/s)", ylabel="p90 TTFT (s)",
               title=f"{name}: bandwidth sweep")
        ax.legend()
    paths.append(_save(fig, out / "sim_bandwidth.png"))
    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 7))
    for col, (name, res) in enumerate(results.items()):
        for sharing in ("on", "off"):
            pts = [r for r in res["sharing"] if r["sharing"] == sharing]
            xs = [r["sessions"] for r in pts]
            axes[0][col].plot(xs, [r["hit_ratio"] for r in pts], "o-", label=f"sharing {sharing}")
            axes[1][col].plot(xs, [r["ttft_p95"] for r in pts], "o-", label=f"sharing {sharing}")
        axes[0][col].set(ylabel="prefix hit ratio", title=f"{name}: cross-module sharing")
        axes[1][col].set(yscale="log", xlabel="concurrent sessions (4 agents each)", ylabel="p95 TTFT (s)")
        axes[0][col].legend()
    paths.append(_save(fig, out / "sim_sharing.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write every row here")
    ap.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    ap.add_argument("--quick", action="store_true", help="short traces (a smoke run)")
    ap.add_argument("--cpu-limit", type=int, default=4000, help="trace requests for the CPU cluster")
    ap.add_argument("--only", choices=("cpu", "gpu"), help="run one cluster")
    args = ap.parse_args(argv)
    setups = [cpu_setup(300 if args.quick else args.cpu_limit), gpu_setup(500 if args.quick else None)]
    if args.quick:
        setups = [replace(s, sessions=s.sessions[:2], bandwidths_gbit=s.bandwidths_gbit[:2]) for s in setups]
    results: dict[str, dict[str, list[Row]]] = {}
    t0 = time.perf_counter()
    for s in setups:
        if args.only and s.name != args.only:
            continue
        reqs = s.trace()
        res: dict[str, list[Row]] = {}
        res["threshold"] = threshold_sweep(s, reqs)
        t = best_threshold(res["threshold"])
        res["bandwidth"] = bandwidth_sweep(s, reqs, t)
        res["ratio"] = ratio_sweep(s, reqs, t)
        res["sharing"] = sharing_sweep(s, t)
        results[s.name] = res
        print(f"\n## {s.name} cluster: {len(reqs)} trace requests; best threshold {t} tokens")
        print(table(f"{s.name}: offload-threshold sweep", res["threshold"], ["threshold", "bw_aware"]))
        print(table(f"{s.name}: bandwidth sweep", res["bandwidth"], ["gbit", "arm"]))
        for gbit in s.bandwidths_gbit:
            rows = [r for r in res["bandwidth"] if r["gbit"] == gbit]
            print(f"- {gbit} Gbit/s: {naive_vs_selective(rows, t)}")
        print(table(f"{s.name}: prefill:decode ratio", res["ratio"], ["ratio"]))
        print(table(f"{s.name}: cross-module sharing vs sessions", res["sharing"], ["sessions", "sharing"],
                    ["ttft_p50", "ttft_p95", "e2e_p95", "req_s", "hit_ratio",
                     "cross_module_hit_ratio", "offloaded_pct", "kv_gb_moved"]))
    print(f"\nall experiments: {time.perf_counter() - t0:.1f} s wall")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.plots and results:
        for p in plot(results, args.plots):
            print(f"wrote {p}")


if __name__ == "__main__":
    main()
