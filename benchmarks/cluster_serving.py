"""The 3-agent workload served colocated vs disaggregated, over HTTP against real server processes.

Each arm is a real ``agentshare serve`` started from this script, measured, then stopped before the
next one starts (one server set at a time)::

    colocated         serve --threads T, the 3 agents in one engine (shared prefill in-process)
    disagg-bf16-shm   serve --disaggregated: 1 prefill + 3 decode workers (one agent each), the
                      router in the parent; bf16 KV over shared memory, the CLI's offload policy
                      (threshold 256 tokens, bandwidth-aware: it may keep a prefill local)
    disagg-bf16-shm-always   the same with ``--no-bandwidth-aware``: every shared prefix above
                      the threshold is offloaded to the prefill worker
    disagg-{bf16,int8}-{shm,tcp}[-always]   the other codecs and transports (optional, --arms)

The workload: T tasks; each task is a fresh shared context of ~C tokens (generated incident
records, distinct per task) and 3 agents (agent0..2) asking their own question over it with OUT
output tokens (``ignore_eos``); a task's 3 requests go out together and tasks run one after
another (closed loop; ``--inflight 1,2`` adds a mode with 2 tasks in flight). One warm-up task
per arm is not measured. Every arm gets the same prompts.

Measured as docs/design.md §7 says: TTFT (to the first SSE chunk carrying a token), ITL, TPOT =
(E2E - TTFT)/(output tokens - 1), E2E, with mean/p50/p90 (p95/p99 when there are >= 20
samples); request and output-token throughput over the wall time; prompt tokens computed vs
served from cache on each worker; KV blocks/bytes moved and the links' transfer seconds (from
the router's ``/internal/cluster``, as deltas over the measured tasks). The ratios printed are
disaggregated / colocated, of medians.

What this machine is, honestly: 2 CPU cores and no accelerator. The colocated arm runs one
engine on both cores. The disaggregated arm runs 4 worker processes (1 torch thread each, not
pinned: 4 > 2 cores) plus the router on the same 2 cores, so the workers time-share the cores
and every transfer is a copy on the same memory bus. Disaggregation pays off when prefill and
decode get their own hardware; here it cannot, and the disaggregated arm is expected to be
slower. This benchmark measures by how much, and whether the prefill worker computes each
shared context once — it is not built to make either arm look good.

    python benchmarks/cluster_serving.py [--context 2048] [--out 32] [--tasks 4] [--reps 1]
        [--arms colocated,disagg-bf16-shm,disagg-bf16-shm-always[,disagg-int8-tcp,...]] [--inflight 1[,2]]
        [--threads 2] [--dtype bfloat16] [--json results/cluster_serving.json]
    python benchmarks/cluster_serving.py --quick      # a smoke run: C=512, OUT=8, T=2, 1 rep
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

try:  # run as a script (benchmarks/ is sys.path[0]) or as ``python -m benchmarks.cluster_serving``
    from engine_sharing import make_loras  # type: ignore[import-not-found]
except ImportError:
    from benchmarks.engine_sharing import make_loras

from agentshare.local_server import free_port
from server.bench.client import RequestResult, stream_chat
from server.engine.numerics import dtype_name, resolve_dtype
from server.kv.family import family_digest
from server.models.loader import default_model_dir
from server.prompt import chat_prompt

ADMIN_KEY = secrets.token_hex(16)  # the router's /internal/cluster asks for it (given by env, not argv)

ROOT = Path(__file__).resolve().parents[1]
N_AGENTS = 3
ARMS: dict[str, tuple[str, str, bool] | None] = {  # codec, transport, always offload
    "colocated": None,
    **{f"disagg-{c}-{t}{'-always' if a else ''}": (c, t, a)
       for a in (False, True) for t in ("shm", "tcp") for c in ("bf16", "int8")},
}
QUESTIONS = (
    "Which services failed most often in the records above? Answer with a short list.",
    "For the incidents above, name the region with the most high-severity tickets and say why.",
    "Write a one-paragraph status update for management about the incidents above.",
)

# ---- the prompts ------------------------------------------------------------------------------

_SERVICES = ["checkout", "payments", "search", "auth", "inventory", "notifications", "billing", "recommendations",
             "shipping", "catalog", "reporting", "image-resizer", "session-store", "rate-limiter"]
_REGIONS = ["eu-west-1", "eu-central-1", "us-east-1", "us-west-2", "ap-south-1", "ap-northeast-1", "sa-east-1"]
_PEOPLE = ["Priya Natarajan", "Tomás Ribeiro", "Mei Lin", "Jonas Becker", "Aisha Bello", "Lukas Novak",
           "Sofia Rossi", "Daniel Okafor", "Hannah Schmidt", "Kenji Watanabe", "Olivia Carter", "Mateo García"]
_CUSTOMERS = ["Acme Logistics", "Northwind Traders", "Globex", "Initech", "Umbrella Health", "Stark Retail",
              "Wayne Foods", "Tyrell Mobility", "Soylent Energy", "Hooli Media"]
_SYMPTOMS = ["returned HTTP 503 for {m} minutes", "timed out on {p}% of requests", "served stale data for {m} minutes",
             "dropped {p}% of messages", "showed p99 latency above {s} seconds", "rejected logins for {m} minutes",
             "double-charged {n} orders", "lost connection to its primary database"]
_CAUSES = ["the connection pool was exhausted after a traffic spike", "a config push disabled the cache layer",
           "a certificate expired on the internal load balancer", "a schema migration locked the orders table",
           "a noisy neighbour saturated the shared disk", "a retry storm amplified a brief network partition",
           "the autoscaler hit its instance quota", "a memory leak in release {v} exhausted the heap",
           "DNS resolution failed for the metadata service", "a feature flag sent all traffic to one shard"]
_ACTIONS = ["rolled back release {v}", "raised the pool size and restarted the pods", "renewed the certificate",
            "killed the blocking migration", "moved the volume to dedicated disks", "added jitter to client retries",
            "requested a quota increase and shed low-priority load", "failed over to the standby database",
            "disabled the feature flag", "patched the leak and redeployed"]


def _record(rng: random.Random, task: int, i: int) -> str:
    v = f"{rng.randint(3, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}"
    sym = rng.choice(_SYMPTOMS).format(m=rng.randint(2, 90), p=rng.randint(1, 60), s=rng.randint(2, 30),
                                       n=rng.randint(3, 400))
    return (f"Ticket #{task * 1000 + 100 + i} ({2024 + rng.randint(0, 1)}-{rng.randint(1, 12):02d}-"
            f"{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} UTC, region "
            f"{rng.choice(_REGIONS)}, severity {rng.choice(['low', 'medium', 'high', 'critical'])}): customer "
            f"{rng.choice(_CUSTOMERS)} reported that the {rng.choice(_SERVICES)} service {sym}. On-call engineer "
            f"{rng.choice(_PEOPLE)} {rng.choice(_ACTIONS).format(v=v)}. Root cause: "
            f"{rng.choice(_CAUSES).format(v=v)}.")


def make_context(tokenizer: Any, task: int, tokens: int) -> str:
    """Distinct, real-looking incident records for ``task``, just reaching ``tokens`` tokens."""
    rng = random.Random(7919 * task + 17)
    text = f"Incident log, batch {task}. Each record is one ticket.\n"
    i = 0
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += "\n" + _record(rng, task, i)
        i += 1
    return text


@dataclass(frozen=True)
class Task:
    index: int
    context: str
    prompt_tokens: tuple[int, ...]  # per agent, as the server's chat template renders it
    context_tokens: int


def make_tasks(tokenizer: Any, n: int, tokens: int, first: int = 0) -> list[Task]:
    out = []
    for t in range(first, first + n):
        ctx = make_context(tokenizer, t, tokens)
        prompts = [chat_prompt(tokenizer, [{"role": "user", "content": ctx}], [{"role": "user", "content": q}])
                   for q in QUESTIONS]
        out.append(Task(t, ctx, tuple(len(p.token_ids) for p in prompts), prompts[0].context_len))
    return out


# ---- the client -------------------------------------------------------------------------------


@dataclass
class Result:
    task: int
    agent: str
    start: float
    ttft: float = float("nan")
    e2e: float = float("nan")
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float:
        n = self.completion_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else float("nan")


async def chat(client: httpx.AsyncClient, url: str, task: Task, agent: int, out: int) -> Result:
    """One agent's streamed request, timed by agentshare bench's client (server/bench/client.py)."""
    body = {"model": f"agent{agent}", "temperature": 0, "max_tokens": out, "ignore_eos": True,
            "messages": [{"role": "user", "content": task.context}, {"role": "user", "content": QUESTIONS[agent]}]}
    s = await stream_chat(client, url, body, RequestResult(task.index, f"agent{agent}", 0, 0.0, out))
    r = Result(task.index, s.agent, s.sent, prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens or 0,
               completion_tokens=s.completion_tokens, error=s.error)
    if s.first is not None:
        r.ttft, r.itl = s.first - s.sent, s.itl
        r.e2e = (s.done if s.done is not None else time.perf_counter()) - s.sent
    return r


async def run_tasks(url: str, tasks: list[Task], out: int, inflight: int) -> tuple[list[Result], float]:
    """The tasks, ``inflight`` at a time (closed loop); a task's agents go out together."""
    queue = list(tasks)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:

        async def lane() -> None:
            while queue:
                task = queue.pop(0)
                results.extend(await asyncio.gather(*(chat(client, url, task, a, out) for a in range(N_AGENTS))))

        t0 = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(inflight)))
        wall = time.perf_counter() - t0
    return results, wall


# ---- the servers ------------------------------------------------------------------------------


class Server:
    """One ``agentshare serve`` (and, disaggregated, its worker children) in its own process group."""

    def __init__(self, args: list[str], port: int, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # closed in stop
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "AGENTSHARE_ADMIN_KEY": ADMIN_KEY}
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port), *args],
                                     cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.pgid = self.proc.pid
        self.stray: list[str] = []  # "pid command" of what outlived the SIGTERM

    def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server at {self.url} not ready after {timeout:g} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def group(self) -> list[str]:
        """Processes still in this server's process group (pid and command line)."""
        r = subprocess.run(["pgrep", "-a", "-g", str(self.pgid)], capture_output=True, text=True, check=False)
        return [line for line in r.stdout.splitlines() if line.strip()]

    def stop(self) -> None:
        """SIGTERM the serve process (it stops its own workers); anything left in the group after
        that is recorded in ``stray`` and killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.stray.append(f"serve pid {self.proc.pid} ignored SIGTERM for 40 s")
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 10
        while self.group() and time.monotonic() < deadline:
            time.sleep(0.5)
        left = self.group()
        if left:
            self.stray += left
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()


def server_args(arm: str, model_dir: Path, modules: dict[str, Path], args: argparse.Namespace) -> list[str]:
    common = ["--model", str(model_dir), "--dtype", args.dtype, "--kv-cache", args.kv_cache, "--log-level", "warning"]
    for name, path in modules.items():
        common += ["--module", f"{name}={path}"]
    spec = ARMS[arm]
    if spec is None:
        return [*common, "--threads", str(args.threads)]
    codec, transport, always = spec
    out = [*common, "--disaggregated", "--prefill-workers", "1", "--decode-workers", str(N_AGENTS),
           "--transfer-codec", codec, "--transport", transport]
    if always:
        out.append("--no-bandwidth-aware")
    if args.offload_threshold is not None:
        out += ["--offload-threshold", str(args.offload_threshold)]
    return out  # no --threads: the launcher gives each of the 4 workers cores // 4 = 1 thread


# ---- server-side counters ---------------------------------------------------------------------

_METRIC = re.compile(r'^(agentshare_[a-z_]+)(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$')


def read_counters(url: str, disaggregated: bool) -> dict[str, Any]:
    if disaggregated:
        return httpx.get(f"{url}/internal/cluster", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30).json()
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[f"{m[1]}{{{m[2]}}}" if m[2] else m[1]] = float(m[3])
    return out


def counter_delta(before: dict[str, Any], after: dict[str, Any], disaggregated: bool) -> dict[str, Any]:
    if not disaggregated:
        def d(key: str) -> int:
            return int(after.get(key, 0) - before.get(key, 0))

        return {"workers": [{
            "role": "colocated",
            "prompt_tokens": d("agentshare_prompt_tokens_total"),
            "prefill_tokens": d('agentshare_prefill_tokens_total{source="computed"}'),
            "cached_prompt_tokens": d('agentshare_prefill_tokens_total{source="cached"}'),
            "cross_module_hit_blocks": d('agentshare_cache_blocks_total{outcome="cross_module_hit"}'),
            "inflight_hit_blocks": d('agentshare_cache_blocks_total{outcome="inflight_hit"}'),
        }]}
    keys = ("prompt_tokens", "cached_prompt_tokens", "prefill_tokens", "decode_tokens", "finished", "hit_blocks",
            "miss_blocks", "inflight_hit_blocks", "cross_module_hit_blocks", "exported_blocks", "imported_blocks",
            "transfers_ok", "transfers_failed", "checksum_failures", "evictions")
    workers = []
    for wb, wa in zip(before["workers"], after["workers"], strict=True):
        sb, sa = wb.get("stats") or {}, wa.get("stats") or {}
        w: dict[str, Any] = {"url": wa["url"], "role": wa["role"], "agents": wa["agents"], "alive": wa["alive"]}
        w.update({k: int(sa.get(k, 0)) - int(sb.get(k, 0)) for k in keys})
        for side in ("sent", "received"):
            lb, la = sb.get(side) or {}, sa.get(side) or {}
            links = {}
            for peer, fig in la.items():
                old = lb.get(peer, {})
                links[peer] = {f: fig.get(f, 0) - old.get(f, 0) for f in ("bytes", "frames", "transfers", "failures",
                                                                          "seconds")}
            w[side] = links
            w[f"bytes_{side}"] = sum(x["bytes"] for x in links.values())
            w[f"seconds_{side}"] = sum(x["seconds"] for x in links.values())
        workers.append(w)
    decisions = {k: n for k in after["decisions"] if (n := after["decisions"][k] - before["decisions"].get(k, 0))}
    return {"workers": workers, "decisions": decisions,
            **{k: after.get(k, 0) - before.get(k, 0) for k in ("retries", "transfer_failures", "workers_down",
                                                               "rejoined")}}


# ---- statistics -------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN when empty."""
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(xs: list[float]) -> dict[str, float]:
    xs = [x for x in xs if not math.isnan(x)]
    out = {"n": len(xs), "mean": statistics.fmean(xs) if xs else float("nan"), "p50": pct(xs, 50), "p90": pct(xs, 90)}
    if len(xs) >= 20:
        out |= {"p95": pct(xs, 95), "p99": pct(xs, 99)}
    return out


def arm_summary(results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(results), "errors": [r.error for r in results if r.error], "wall_s": wall,
        "ttft_s": summary([r.ttft for r in ok]), "e2e_s": summary([r.e2e for r in ok]),
        "tpot_s": summary([r.tpot for r in ok]), "itl_s": summary([x for r in ok for x in r.itl]),
        "request_throughput": len(ok) / wall, "output_throughput": out_tokens / wall,
        "completion_tokens": out_tokens, "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens_reported": sum(r.cached_tokens for r in ok),
    }


# ---- one arm ----------------------------------------------------------------------------------


def run_arm(arm: str, model_dir: Path, modules: dict[str, Path], warm: list[Task],
            tasks: dict[int, list[Task]], args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Start the arm's server, run the warm-up task, then each mode on its own fresh tasks."""
    disagg = ARMS[arm] is not None
    port = free_port()
    server = Server(server_args(arm, model_dir, modules, args), port, log_dir / f"{arm}-{port}.log")
    out: dict[str, Any] = {"arm": arm}
    try:
        out["startup_s"] = server.wait_ready(args.startup_timeout)
        if disagg:
            cl = read_counters(server.url, True)
            out["workers"] = [{"role": w["role"], "agents": w["agents"]} for w in cl["workers"]]
        before = read_counters(server.url, disagg)
        results, wall = asyncio.run(run_tasks(server.url, warm, args.out, 1))
        time.sleep(0.3)
        out["warmup"] = arm_summary(results, wall) | {
            "counters": counter_delta(before, read_counters(server.url, disagg), disagg)}
        out["modes"] = {}
        for inflight in args.inflight:
            before = read_counters(server.url, disagg)
            results, wall = asyncio.run(run_tasks(server.url, tasks[inflight], args.out, inflight))
            time.sleep(0.3)  # let the last transfer acknowledgements land in the counters
            after = read_counters(server.url, disagg)
            mode = arm_summary(results, wall)
            mode["counters"] = counter_delta(before, after, disagg)
            mode["results"] = [r.__dict__ | {"tpot": r.tpot} for r in results]
            out["modes"][str(inflight)] = mode
            for e in mode["errors"][:3]:
                print(f"  [{arm}, {inflight} in flight] request error: {e}", file=sys.stderr)
    except Exception as exc:  # an arm that fails is reported; the others still run
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  [{arm}] failed: {out['error']}\n--- server log tail ---\n{server.log_tail()}", file=sys.stderr)
    finally:
        server.stop()
        out["stray_processes"] = server.stray
        if server.stray:
            print(f"  [{arm}] {len(server.stray)} process(es) outlived the serve process's SIGTERM (killed now): "
                  f"{', '.join(short(p) for p in server.stray)}", file=sys.stderr)
    return out


# ---- the report -------------------------------------------------------------------------------


def short(process: str) -> str:
    """``pid role`` of a ``pgrep -a`` line."""
    pid, _, cmd = process.partition(" ")
    role = re.search(r"--role (\w+)", cmd)
    return f"{pid} {role[1] + ' worker' if role else cmd[:40]}"


def fmt_ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}"


def print_arm_table(arms: list[dict[str, Any]], inflight: str) -> None:
    print(f"\n== {inflight} task(s) in flight: latency in ms (mean / p50 / p90), throughput over the wall time")
    print(f"{'arm':<24} {'n':>3} {'TTFT mean':>9} {'p50':>6} {'p90':>6} {'E2E mean':>9} {'p50':>6} {'p90':>6} "
          f"{'TPOT p50':>8} {'ITL p50':>7} {'req/s':>6} {'tok/s':>6} {'wall s':>6}")
    for a in arms:
        m = a.get("modes", {}).get(inflight)
        if m is None:
            print(f"{a['arm']:<24} failed: {a.get('error', '?')}")
            continue
        t, e = m["ttft_s"], m["e2e_s"]
        print(f"{a['arm']:<24} {t['n']:>3} {fmt_ms(t['mean']):>9} {fmt_ms(t['p50']):>6} {fmt_ms(t['p90']):>6} "
              f"{fmt_ms(e['mean']):>9} {fmt_ms(e['p50']):>6} {fmt_ms(e['p90']):>6} {fmt_ms(m['tpot_s']['p50']):>8} "
              f"{fmt_ms(m['itl_s']['p50']):>7} {m['request_throughput']:>6.2f} {m['output_throughput']:>6.1f} "
              f"{m['wall_s']:>6.1f}")
        if "p95" in t:
            print(f"{'':<24}     TTFT p95 {fmt_ms(t['p95'])} p99 {fmt_ms(t['p99'])}; "
                  f"E2E p95 {fmt_ms(e.get('p95', float('nan')))} p99 {fmt_ms(e.get('p99', float('nan')))}")
        if m["errors"]:
            print(f"{'':<24}     {len(m['errors'])} request error(s), first: {m['errors'][0]}")


def print_work(arms: list[dict[str, Any]], title: str, pick: Any) -> None:
    print(f"\n-- work per worker {title} (prompt tokens: received / computed / cached; KV moved)")
    for a in arms:
        m = pick(a)
        if m is None or "counters" not in m:
            continue
        c = m["counters"]
        for w in c["workers"]:
            who = f"{w['role']}" + (f"[{','.join(w['agents'])}]" if w.get("agents") else "")
            line = (f"{a['arm']:<24} {who:<20} prompt {w['prompt_tokens']:>6} / {w['prefill_tokens']:>6} / "
                    f"{w['cached_prompt_tokens']:>6}")
            if "exported_blocks" in w:
                if w["role"] == "prefill":
                    line += (f"  exported {w['exported_blocks']} blocks, {w['bytes_sent'] / 2**20:.1f} MiB "
                             f"in {w['seconds_sent']:.2f} s link time")
                else:
                    line += (f"  imported {w['imported_blocks']} blocks, {w['bytes_received'] / 2**20:.1f} MiB "
                             f"in {w['seconds_received']:.2f} s")
                if w["transfers_failed"]:
                    line += f"  FAILED transfers {w['transfers_failed']}"
            else:
                line += f"  cross-module hit blocks {w['cross_module_hit_blocks']}"
            print(line)
        if "decisions" in c:
            print(f"{a['arm']:<24} routing decisions {c['decisions']}; retries {c['retries']}, transfer failures "
                  f"{c['transfer_failures']}, workers down {c['workers_down']}")


def ratios(arms: list[dict[str, Any]], inflight: str) -> dict[str, dict[str, float]]:
    base = next((a for a in arms if a["arm"] == "colocated" and inflight in a.get("modes", {})), None)
    if base is None:
        return {}
    b = base["modes"][inflight]
    out = {}
    for a in arms:
        if a["arm"] == "colocated" or inflight not in a.get("modes", {}):
            continue
        m = a["modes"][inflight]
        out[a["arm"]] = {
            "ttft_p50": m["ttft_s"]["p50"] / b["ttft_s"]["p50"], "e2e_p50": m["e2e_s"]["p50"] / b["e2e_s"]["p50"],
            "tpot_p50": m["tpot_s"]["p50"] / b["tpot_s"]["p50"],
            "output_throughput": m["output_throughput"] / b["output_throughput"],
            "wall": m["wall_s"] / b["wall_s"],
        }
    return out


def print_ratios(r: dict[str, dict[str, float]], inflight: str) -> None:
    if not r:
        return
    print(f"\n-- disaggregated / colocated, {inflight} in flight (medians; >1 = slower for latency, "
          "<1 = less throughput)")
    print(f"{'arm':<24} {'TTFT p50':>9} {'E2E p50':>8} {'TPOT p50':>9} {'tok/s':>6} {'wall':>6}")
    for arm, x in r.items():
        print(f"{arm:<24} {x['ttft_p50']:>8.2f}x {x['e2e_p50']:>7.2f}x {x['tpot_p50']:>8.2f}x "
              f"{x['output_throughput']:>5.2f}x {x['wall']:>5.2f}x")


def merge_reps(reps: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Pool the arms' requests over repetitions (throughput: total over summed wall time)."""
    if len(reps) == 1:
        return reps[0]
    merged = []
    for name in dict.fromkeys(a["arm"] for rep in reps for a in rep):
        runs = [a for rep in reps for a in rep if a["arm"] == name]
        arm: dict[str, Any] = {"arm": name, "modes": {}, "reps": len(runs),
                               "stray_processes": [s for a in runs for s in a["stray_processes"]]}
        if runs[-1].get("warmup"):
            arm["warmup"] = runs[-1]["warmup"]
        errors = [a["error"] for a in runs if "error" in a]
        if errors:
            arm["error"] = "; ".join(errors)
        for mode in dict.fromkeys(k for a in runs for k in a.get("modes", {})):
            ms = [a["modes"][mode] for a in runs if mode in a.get("modes", {})]
            results = [Result(**{k: v for k, v in r.items() if k != "tpot"}) for m in ms for r in m["results"]]
            pooled = arm_summary(results, sum(m["wall_s"] for m in ms))
            pooled["counters"] = ms[-1]["counters"]  # the last rep's (the per-rep ones are in the JSON)
            pooled["per_rep"] = ms
            arm["modes"][mode] = pooled
        merged.append(arm)
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (both arms; auto resolves to "
                    "bfloat16 on this machine)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the colocated server")
    ap.add_argument("--context", type=int, default=2048, help="shared-context tokens per task")
    ap.add_argument("--out", type=int, default=32, help="output tokens per agent")
    ap.add_argument("--tasks", type=int, default=4, help="measured tasks per arm (after 1 warm-up task)")
    ap.add_argument("--reps", type=int, default=1, help="passes over all arms (servers restarted; order alternates)")
    ap.add_argument("--arms", default="colocated,disagg-bf16-shm,disagg-bf16-shm-always", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--inflight", default="1", help="tasks in flight, comma-separated modes, e.g. 1,2")
    ap.add_argument("--offload-threshold", type=int, default=None, help="disaggregated: offload prefills longer "
                    "than this (default: the CLI's, 256 tokens)")
    ap.add_argument("--kv-cache", default="512MiB", help="KV pool of every engine (each worker, or the one server)")
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--quick", action="store_true", help="C=512, OUT=8, T=2, 1 rep")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.context, args.out, args.tasks, args.reps = 512, 8, 2, 1
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    args.inflight = [int(x) for x in args.inflight.split(",")]
    dt = resolve_dtype(args.dtype)
    args.dtype = dtype_name(dt)

    from transformers import AutoTokenizer

    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    family = family_digest(model_dir, kv_dtype=args.dtype)
    warm = make_tasks(tokenizer, 1, args.context, first=0)
    # each mode its own fresh contexts (a mode must not hit the previous mode's cache); every arm the same
    tasks = {k: make_tasks(tokenizer, args.tasks, args.context, first=1 + i * args.tasks)
             for i, k in enumerate(args.inflight)}
    every = [t for ts in tasks.values() for t in ts]
    print(f"SmolLM2-135M, {args.dtype}, {os.cpu_count()} CPU cores; {N_AGENTS} agents x {args.tasks} tasks "
          f"(+1 warm-up) per arm; context ~{args.context} tokens "
          f"(rendered: {statistics.median(t.context_tokens for t in every):.0f}), prompts "
          f"{min(p for t in every for p in t.prompt_tokens)}-{max(p for t in every for p in t.prompt_tokens)} "
          f"tokens, {args.out} output tokens; tasks in flight {args.inflight}; colocated threads {args.threads}, "
          f"disaggregated 1 prefill + {N_AGENTS} decode workers x 1 thread")
    result: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cpu_cores": os.cpu_count(), "family": family,
        "tasks": {k: [{"index": t.index, "context_tokens": t.context_tokens, "prompt_tokens": t.prompt_tokens}
                      for t in ts] for k, ts in tasks.items()},
    }
    reps: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="cluster_serving-") as tmp:
        t0 = time.perf_counter()
        modules = make_loras(model_dir, N_AGENTS, family, Path(tmp))
        print(f"made {N_AGENTS} LoRA modules in {time.perf_counter() - t0:.0f} s")
        log_dir = Path(tmp) / "logs"
        log_dir.mkdir()
        for rep in range(args.reps):
            order = arms if rep % 2 == 0 else arms[::-1]
            this = []
            for arm in order:
                print(f"[rep {rep + 1}/{args.reps}] {arm}: starting ...", flush=True)
                t0 = time.perf_counter()
                a = run_arm(arm, model_dir, modules, warm, tasks, args, log_dir)
                print(f"[rep {rep + 1}/{args.reps}] {arm}: done in {time.perf_counter() - t0:.0f} s "
                      f"(start-up {a.get('startup_s', float('nan')):.0f} s)", flush=True)
                this.append(a)
            reps.append(sorted(this, key=lambda a: arms.index(a["arm"])))
    merged = merge_reps(reps)
    result["arms"] = merged
    result["ratios"] = {}
    for inflight in map(str, args.inflight):
        print_arm_table(merged, inflight)
        print_work(merged, f"over the measured {args.tasks} task(s), {inflight} in flight",
                   lambda a, k=inflight: a.get("modes", {}).get(k))
        result["ratios"][inflight] = ratios(merged, inflight)
        print_ratios(result["ratios"][inflight], inflight)
    print_work(merged, "over the (unmeasured) warm-up task, cold: its decisions are the cold router's",
               lambda a: a.get("warmup"))
    stray = [s for a in merged for s in a.get("stray_processes", [])]
    print(f"\nprocesses that outlived SIGTERM to their serve process (then killed): {len(stray)}"
          + (f" ({', '.join(short(p) for p in stray)})" if stray else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
