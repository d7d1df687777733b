"""Agent sessions under load, every arm on one KV budget: where sharing one prefill pays.

Each arm is a server this script starts, on the same cores, one arm after the other; each is
driven by ``agentshare bench``'s code (server/bench) through the same sessions (the same seed
at each rate), at each offered rate in turn (Poisson session arrivals), then stopped::

    shared        agentshare, torch engine: K LoRA modules, one prefill of each shared context
    private       the same server, each agent under a cache_salt of its own: sharing off, how vLLM
                  and SGLang key adapters (K copies of every context)
    base          the same server, the base model for all K agents (no specialists)
    vllm-lora     vLLM --enable-lora with the K adapters, prefix caching on: what users run today
    vllm-base     vLLM, the base model for all K agents
    agentshare-vllm   agentshare serve --engine vllm: vLLM instances sharing the base's prefill

The KV budget is the same for every arm, counted over every pool and store the arm holds:
``--kv-cache`` (torch engine), ``--kv-cache-memory-bytes`` (vLLM), and for agentshare-vllm its two
instances' caches plus its ``--kv-store``, a third each. The modules are random rank-8 LoRAs
(untrained adapters: the speed of serving them does not depend on their training).

Capacity (server/bench/metrics.py ``sustained``): the highest offered rate at which the achieved
session rate is at least 95 % of it and p95 TTFT does not grow from the first half of the run
to the second. With ``--fractions``, a second phase runs every arm at those fractions of the
``private`` arm's capacity (the papers' comparison points).

    python benchmarks/under_load.py --quick             # K=3, arms shared/private/base, 3 rates, 8 sessions each
    python benchmarks/under_load.py --json benchmarks/recorded/under_load.json --plot docs/img/under_load.png
    python benchmarks/under_load.py --arms shared,private,base,vllm-lora,vllm-base --vllm-python .venv-vllm/bin/python
    python benchmarks/under_load.py --model DIR --rates 1,2 --duration 4   # the tests' twin: a tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("shared", "private", "base", "vllm-lora", "vllm-base", "agentshare-vllm")
QUICK = dict(agents=3, arms="shared,private,base", rates="0.1,0.15,0.2", sessions=8, context="500-1000",
             steps=3, kv_budget="192MiB")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the documented default sweep: " + json.dumps(QUICK))
    ap.add_argument("--agents", type=int, default=3, help="K: agents (LoRA modules) per session")
    ap.add_argument("--arms", default="shared,private,base", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--workload", default="react", help="react, reflexion, burst or trace:FILE")
    ap.add_argument("--rates", default="0.1,0.2,0.3", help="offered sessions per second, swept in order")
    ap.add_argument("--fractions", default="", help="then every arm at these fractions of the private arm's "
                    "capacity, e.g. 0.5,0.8,0.95")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate (default: "
                    "--sessions / rate, so every rate runs as many sessions)")
    ap.add_argument("--sessions", type=int, default=12, help="sessions per rate (their arrivals span about "
                    "sessions / rate seconds)")
    ap.add_argument("--context", default="500-1000", help="tokens of each session's context")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--think", default="0.5-2")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--kv-budget", default="192MiB", help="KV bytes per arm, over every pool and store it holds")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the torch-engine server "
                    "(default: the cores it may use)")
    ap.add_argument("--cores", help="cores every server runs on, e.g. 0-1 (default: all this process may use)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: the default model)")
    ap.add_argument("--vllm-python", help="interpreter with vllm for the vllm arms (default: "
                    "$AGENTSHARE_VLLM_PYTHON, else this one if it has the vllm extra)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="p95 TTFT and throughput against the offered rate, one line per arm")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    args.arm_list = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(args.arm_list) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}: choose from {', '.join(ARMS)}")
    args.rate_list = [float(r) for r in args.rates.split(",") if r.strip()]
    args.fraction_list = [float(f) for f in args.fractions.split(",") if f.strip()]
    return args


def server_command(arm: str, args: argparse.Namespace, model_dir: Path, modules: dict[str, Path], port: int,
                   budget: int, vllm_py: str | None) -> tuple[list[str], dict[str, str]]:
    """The command that starts ``arm``'s server on ``port``, and its environment."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if arm in ("shared", "private", "base", "agentshare-vllm"):
        py = vllm_py if arm == "agentshare-vllm" else sys.executable
        assert py is not None
        cmd = [py, "-m", "server.cli", "serve", "--port", str(port), "--model", str(model_dir), "--dtype",
               args.dtype, "--log-level", "warning", "--max-running", "64"]
        cmd += [a for name, d in modules.items() for a in ("--module", f"{name}={d}")]
        if arm == "agentshare-vllm":  # a base instance and one LoRA instance, and the prefix store
            cmd += ["--engine", "vllm", "--kv-cache", str(budget // 3), "--kv-store", str(budget // 3)]
        else:
            cmd += ["--kv-cache", str(budget)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
        return cmd, env
    assert vllm_py is not None
    env |= {"VLLM_CACHE_ROOT": str(Path(tempfile.gettempdir()) / "agentshare-under-load-vllm"),
            "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    cmd = [vllm_py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
           "base", "--dtype", args.dtype, "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "4096",
           "--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-cache-memory-bytes", str(budget)]
    if arm == "vllm-lora":
        cmd += ["--enable-lora", "--max-loras", str(len(modules)), "--max-lora-rank", "8", "--lora-modules",
                *(f"{name}={d}" for name, d in modules.items())]
    return cmd, env


def agents_of(arm: str, modules: dict[str, Path], k: int) -> list[str]:
    return ["base"] * k if arm in ("base", "vllm-base") else list(modules)


def run_arm(arm: str, args: argparse.Namespace, work_for: Any, rates: list[float], seed_of: dict[float, int],
            model_dir: Path, modules: dict[str, Path], budget: int, vllm_py: str | None, cores: str,
            log_dir: Path) -> dict[str, Any]:
    """Start the arm's server, drive it at each rate (a fresh seed per rate, the same in every
    arm), stop it; the bench result of each rate."""
    from headline_http import free_port, launch  # type: ignore[import-not-found]

    from server.bench import Load, Options, bench
    from server.bench.report import profile

    port = free_port()
    cmd, env = server_command(arm, args, model_dir, modules, port, budget, vllm_py)
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"arm": arm, "command": cmd, "runs": []}
    work = work_for(agents_of(arm, modules, args.agents))
    with launch(arm, cmd, env, cores, log_dir / f"{arm}.log", url, timeout=900) as startup:
        out["startup_s"] = startup
        for rate in rates:
            duration = args.duration if args.duration is not None else args.sessions / rate
            opts = Options(duration_s=duration, max_sessions=args.sessions, seed=seed_of[rate],
                           arrival_seed=args.seed, warmup=1,
                           request_timeout_s=600,
                           salt_per_agent=arm == "private", progress=not args.no_progress)
            t0 = time.perf_counter()
            result = asyncio.run(bench(url, work, [Load(rate=rate)], opts, label=arm))
            run = result["runs"][0]
            out["runs"].append(run)
            out.setdefault("host", result["host"])
            s, p = run["summary"], profile(run)
            print(f"  {arm} at {rate:g} sessions/s (arrived at {s.get('arrival_rate') or 0:.3f}/s; "
                  f"{time.perf_counter() - t0:.0f} s): "
                  f"{s['completed']}/{s['requests']} requests, p95 TTFT {s['p95_ttft_ms']:.0f} ms, "
                  f"{s['output_throughput']:.1f} tok/s, hit {100 * (s['cache_hit_ratio'] or 0):.0f}%, "
                  f"{'held' if run['sustained'][0] else 'not held'}: {run['sustained'][1]}\n"
                  f"    profile: TTFT p50 {s['median_ttft_ms']:.0f} ms (queued {p['mean_queue_ms'] or 0:.0f} ms on "
                  f"average), TPOT p50 {s['median_tpot_ms']:.0f} ms at {p['mean_running'] or 0:.1f} running, "
                  f"prefill {p['prefill_computed_tokens'] or 0:.0f} tokens computed / "
                  f"{p['prefill_cached_tokens'] or 0:.0f} cached, {p['evicted_blocks'] or 0:.0f} blocks evicted", flush=True)
    return out


def compare(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Capacity per arm and the ratios the papers report, at every rate all arms ran."""
    from server.bench.report import capacity, profile

    out: dict[str, Any] = {"capacity": {a: capacity(r["runs"]) for a, r in arms.items()}}
    cap = out["capacity"]
    if cap.get("shared") and cap.get("private"):
        out["capacity_shared_over_private"] = cap["shared"] / cap["private"]
    per_rate: dict[float, dict[str, Any]] = {}
    for arm, r in arms.items():
        for run in r["runs"]:
            s = run["summary"]
            per_rate.setdefault(run["load"]["session_rate"], {})[arm] = {
                "arrival_rate": s.get("arrival_rate"), "p95_ttft_ms": s["p95_ttft_ms"], "p95_e2el_ms": s["p95_e2el_ms"], "p95_session_s": s["p95_session_s"],
                "output_throughput": s["output_throughput"], "cache_hit_ratio": s["cache_hit_ratio"],
                "failed": s["failed"], "sustained": run["sustained"][0], "profile": profile(run)}
    for fig in per_rate.values():
        ref = fig.get("shared", {}).get("p95_ttft_ms")
        for arm, f in fig.items():
            if ref and arm != "shared":
                f["p95_ttft_over_shared"] = f["p95_ttft_ms"] / ref
    out["by_rate"] = {f"{r:g}": v for r, v in sorted(per_rate.items())}
    return out


def print_comparison(cmp: dict[str, Any]) -> None:
    print("\ncapacity (sessions/s): " + ", ".join(f"{a} {c if c is not None else '<lowest rate'}"
                                                  for a, c in cmp["capacity"].items()))
    if "capacity_shared_over_private" in cmp:
        print(f"shared / private capacity: {cmp['capacity_shared_over_private']:.2f}x")
    arms = list(next(iter(cmp["by_rate"].values()), {}))
    print(f"{'rate':>6} " + " ".join(f"{a + ' p95 TTFT':>22}" for a in arms))
    for rate, fig in cmp["by_rate"].items():
        cells = []
        for a in arms:
            f = fig.get(a)
            if f is None:
                cells.append(f"{'-':>22}")
                continue
            ratio = f" ({f['p95_ttft_over_shared']:.1f}x)" if "p95_ttft_over_shared" in f else ""
            cells.append(f"{f['p95_ttft_ms'] / 1e3:>12.2f} s{ratio:<8}"[:22].rjust(22))
        print(f"{rate:>6} " + " ".join(cells))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the servers too
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from engine_sharing import make_loras  # type: ignore[import-not-found]
    from headline_http import cpu_ranges, vllm_python  # type: ignore[import-not-found]
    from transformers import AutoTokenizer

    from server.api.serve import parse_bytes
    from server.bench.report import jsonable, plot
    from server.bench.text import Corpus
    from server.bench.workloads import make_workload, parse_range
    from server.engine.numerics import dtype_name, resolve_dtype
    from server.kv.family import family_digest
    from server.models.loader import default_model_dir

    model_dir = args.model or default_model_dir()
    budget = parse_bytes(args.kv_budget)
    cores = cpu_ranges(sorted(os.sched_getaffinity(0))) if not args.cores else args.cores
    vllm_py, vinfo = (None, "no vllm arm asked for")
    if any(a.startswith("vllm") or a == "agentshare-vllm" for a in args.arm_list):
        vllm_py, vinfo = vllm_python(args.vllm_python)
        if vllm_py is None:
            print(f"the vllm arms are skipped: {vinfo}")
            args.arm_list = [a for a in args.arm_list if not (a.startswith("vllm") or a == "agentshare-vllm")]
    corpus = Corpus(AutoTokenizer.from_pretrained(model_dir))

    def work_for(agents: list[str]) -> Any:
        return make_workload(args.workload, corpus, agents, steps=args.steps, context=parse_range(args.context, "context"),
                             think=parse_range(args.think, "think"), output_tokens=args.output_tokens)

    seed_of = {r: args.seed + 1000 * i for i, r in enumerate(args.rate_list)}
    log_dir = Path(tempfile.mkdtemp(prefix="under_load_"))
    res: dict[str, Any] = {"benchmark": "under_load", "command": " ".join(["python", *sys.argv]),
                           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "kv_budget_bytes": budget, "cores": cores, "model": str(model_dir), "vllm": vinfo,
                           "logs": str(log_dir), "arms": {}}
    each = f"{args.duration:g} s" if args.duration is not None else f"{args.sessions} sessions"
    print(f"{len(args.arm_list)} arms, {args.agents} agents, rates {args.rate_list} sessions/s, {each} "
          f"each, KV budget {budget / 2**20:.0f} MiB per arm, cores {cores}; logs in {log_dir}", flush=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ExitStack():
        family = family_digest(model_dir, kv_dtype=dtype_name(resolve_dtype(args.dtype)))
        modules = make_loras(model_dir, args.agents, family, Path(tmp))
        for arm in args.arm_list:
            res["arms"][arm] = run_arm(arm, args, work_for, args.rate_list, seed_of, model_dir, modules, budget,
                                       vllm_py, cores, log_dir)
        res["comparison"] = compare(res["arms"])
        private = res["comparison"]["capacity"].get("private")
        if args.fraction_list and private:
            rates = [round(f * private, 4) for f in args.fraction_list]
            seed_of |= {r: args.seed + 500 + 1000 * i for i, r in enumerate(rates)}
            print(f"\nat {args.fraction_list} of the private arm's capacity ({private:g}/s): rates {rates}")
            res["at_fractions"] = {arm: run_arm(arm, args, work_for, rates, seed_of, model_dir, modules, budget,
                                                vllm_py, cores, log_dir) for arm in args.arm_list}
            res["comparison_at_fractions"] = compare(res["at_fractions"])
        elif args.fraction_list:
            print("\nno second phase: the private arm sustained none of the rates (try lower --rates)")
    res["wall_s"] = time.perf_counter() - t_start
    res["host"] = next((a.get("host") for a in res["arms"].values()), None)
    print_comparison(res["comparison"])
    if "comparison_at_fractions" in res:
        print_comparison(res["comparison_at_fractions"])
    print(f"\nwall time {res['wall_s'] / 60:.1f} min")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(jsonable(res), indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        title = (f"{args.workload}, K={args.agents}, KV {budget / 2**20:.0f} MiB per arm, "
                 f"{(res['host'] or {}).get('cpu', '')}")
        print(f"wrote {plot({a: r for a, r in res['arms'].items()}, args.plot, title=title)}")


if __name__ == "__main__":
    main()
