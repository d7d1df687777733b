"""Three agents — retrieval, planning, coding — over ONE shared context: an incident report.

    python examples/three_agents.py                 # launches a local server (the team's base)
    python examples/three_agents.py --url http://127.0.0.1:8000 --api-key K ...   # see --help

It runs the team with sharing on and with sharing off on the same server, side by side:

- sharing on: the report is prefilled once (``client.context``), then the three agents run
  concurrently on it (``ctx.fork``): each computes only its own turn;
- sharing off: each agent runs in a tenant of its own (its own API key, hence its own cache
  salt): it prefills the whole report itself. Same server, same concurrent (batched) decoding,
  same prompts; only the sharing differs.

Nothing cold is timed. What a first run on a machine builds (the default model's conversion, the
team's base patch, the fused kernels for this CPU) is built before the server starts, with its
progress shown, and reported apart as first-run costs. Then one untimed repetition of each arm,
then the arms alternate, ``--reps`` times each, every repetition in fresh tenants (so each one
prefills the report anew); the table gives the median and every repetition.

Trained decode modules in ``examples/modules/<agent>/`` (retrieval, planning, coding; made by
``examples/train_team.py``) are served and used, on the base they were trained for: the default
model with the team's joint prefill patch (``examples/modules/team-base/``), built once in the
cache on the first run. Without them every agent runs on the base model. With them, a second
part runs the team on held-out episodes of the tasks they were trained on and scores it, sharing
on against each module on its own prefill (``examples/team_episodes.py``; ``--episodes 0``
skips it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import anyio
import team_episodes

from agentshare import Agent, AsyncClient, ForkResult, Sampling, ServerMetrics

HERE = Path(__file__).resolve().parent
DOC = HERE / "data" / "incident-report.md"
MODULES = HERE / "modules"
TEAM_BASE = MODULES / "team-base"
"""The shipped modules' base: a patch of the default model (the team's joint prefill)."""
RECORDED = HERE.parent / "benchmarks" / "recorded" / "bf16_agreement.json"

TEAM = (
    ("retrieval", ("You are the retrieval agent. Answer from the report only, quoting it. Question: what "
                  "lock_timeout did the migration's second session run with, and why?")),
    ("planning", ("You are the planning agent. Give the next three steps to carry out action items A1 and A2, "
                 "as a numbered list, one line each.")),
    ("coding", ("You are the coding agent. Write the Python fix for extra_session() that Appendix C "
               "sketches: pass lock_timeout and statement_timeout in the connection options.")),
)


def team(modules: set[str], max_tokens: int) -> list[Agent]:
    return [Agent(name, module=name if name in modules else "base", instruction=instruction,
                  sampling=Sampling(max_tokens=max_tokens, temperature=0))
            for name, instruction in TEAM]


Run = tuple[ForkResult, float, ServerMetrics]
"""One repetition of an arm: the team's answers, its wall time, what the server counted."""


async def sharing_on(url: str, key: str, document: str, agents: list[Agent]) -> Run:
    """The report prefilled once in tenant ``key``, then the three agents forked on it."""
    async with AsyncClient(url, api_key=key) as client:
        before = await client.metrics()
        start = time.perf_counter()
        async with await client.context(document) as ctx:
            prefill = time.perf_counter() - start
            result = await ctx.fork(agents)
        wall = time.perf_counter() - start
        spent = await client.metrics() - before
    print(f"  sharing on:  {wall:6.2f} s (the shared context, {ctx.tokens:,} tokens, prefilled once in "
          f"{prefill:.2f} s, then the three agents in {result.wall:.2f} s)")
    return result, wall, spent


async def sharing_off(url: str, keys: list[str], document: str, agents: list[Agent]) -> Run:
    """Each agent in its own tenant: its own context, its own prefill of the whole report."""
    answers: list[ForkResult | None] = [None] * len(agents)

    async def solo(i: int, key: str, agent: Agent) -> None:
        async with AsyncClient(url, api_key=key) as client, await client.context(document) as ctx:
            answers[i] = await ctx.fork([agent])

    async with AsyncClient(url, api_key=keys[0]) as probe:
        before = await probe.metrics()
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i, (key, agent) in enumerate(zip(keys, agents, strict=True)):
                tg.start_soon(solo, i, key, agent)
        wall = time.perf_counter() - start
        spent = await probe.metrics() - before
    merged = ForkResult(tuple(r[0] for r in answers if r is not None), wall=wall,
                        context_tokens=answers[0].context_tokens if answers[0] else 0)
    print(f"  sharing off: {wall:6.2f} s (each agent prefilled the whole report itself)")
    return merged, wall, spent


def prepare(model: str | None, dtype: str) -> dict[str, float]:
    """Build what a first run on this machine builds, before anything is timed: the base model's
    directory (the default model converted from its GGUF, the team's patch applied) and the fused
    elementwise kernels for its shape on this CPU (a serving process would build them in the
    background, slowing whatever runs meanwhile). Returns the seconds each took; nearly nothing
    once done."""
    from transformers import AutoConfig

    from server.engine import elementwise
    from server.engine.numerics import resolve_dtype
    from server.models.patch import resolve_model_dir

    costs = {}
    start = time.perf_counter()
    path = resolve_model_dir(model)
    costs["model"] = time.perf_counter() - start
    if os.environ.get("AGENTSHARE_FUSED", "auto") == "off":
        return costs
    spec = elementwise.KernelSpec.from_config(AutoConfig.from_pretrained(path), resolve_dtype(dtype))
    if elementwise.load(spec) is None:
        print(f"building the fused kernels for this model's shape on this CPU, once per machine "
              f"(a few minutes), into {elementwise.spec_dir(spec)}:", flush=True)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "server.engine.elementwise", "build", "--spec",
                        json.dumps(dataclasses.asdict(spec))], check=True)
        costs["fused kernels"] = time.perf_counter() - start
    return costs


def report(ons: list[Run], offs: list[Run]) -> str:
    """The side-by-side table: the server's counters of one repetition of each arm (every
    repetition counts the same), wall times as medians over the repetitions, then each one."""
    (r_on, _, m_on), (r_off, _, m_off) = ons[0], offs[0]
    w_on, w_off = statistics.median(w for _, w, _ in ons), statistics.median(w for _, w, _ in offs)
    saved = m_off.prefill_computed_tokens - m_on.prefill_computed_tokens
    rows = [
        ("", "sharing on", "sharing off"),
        ("prompt tokens", f"{m_on.prompt_tokens:,}", f"{m_off.prompt_tokens:,}"),
        ("prefill tokens computed", f"{m_on.prefill_computed_tokens:,}", f"{m_off.prefill_computed_tokens:,}"),
        ("  of which by prefill workers", f"{m_on.exported_tokens:,}", f"{m_off.exported_tokens:,}"),
        ("  of which top layers only (split)", f"{m_on.split_prefix_tokens:,}", f"{m_off.split_prefix_tokens:,}"),
        ("prompt tokens read from cache", f"{m_on.prefill_cached_tokens:,}", f"{m_off.prefill_cached_tokens:,}"),
        ("  of which moved over a link", f"{m_on.imported_tokens:,}", f"{m_off.imported_tokens:,}"),
        (f"wall time, s, median of {len(ons)} (prefill + 3 agents)", f"{w_on:.2f}", f"{w_off:.2f}"),
        ("  each repetition, in the order run", " ".join(f"{w:.2f}" for _, w, _ in ons),
         " ".join(f"{w:.2f}" for _, w, _ in offs)),
        ("mean time to first token, s, median", f"{statistics.median(_mean_ttft(r) for r, _, _ in ons):.2f}",
         f"{statistics.median(_mean_ttft(r) for r, _, _ in offs):.2f}"),
        ("tokens generated", f"{sum(a.usage.completion_tokens for a in r_on)}",
         f"{sum(a.usage.completion_tokens for a in r_off)}"),
    ]
    w0, w1 = max(len(r[0]) for r in rows), max(12, *(len(r[1]) for r in rows), *(len(r[2]) for r in rows))
    lines = [f"{r[0]:<{w0}}  {r[1]:>{w1}}  {r[2]:>{w1}}" for r in rows]
    share = saved / m_off.prefill_computed_tokens if m_off.prefill_computed_tokens else 0.0
    lines.append(f"sharing saved {saved:,} prefill tokens ({share:.0%}) and {w_off - w_on:.2f} s of wall time "
                 f"({w_off / w_on:.2f}x)" if w_on > 0 else "")
    return "\n".join(lines)


def machine(url: str | None, dtype: str, first_run: dict[str, float]) -> str:
    """Where the table was measured (this machine's CPU, for a launched server) and what the first
    run on it cost before anything was timed."""
    if url:
        return f"measured on the server at {url}"
    from server.engine.numerics import cpu_bf16, cpu_model, dtype_name, resolve_dtype

    costs = ", ".join(f"{k} {v:.1f} s" for k, v in first_run.items())
    return (f"measured on {cpu_model()} (bf16 instructions: {cpu_bf16()}), {os.cpu_count()} logical cores, "
            f"{dtype_name(resolve_dtype(dtype))}\nbefore the timed runs, not in them: {costs}")


def _mean_ttft(r: ForkResult) -> float:
    vals = [a.timings.ttft for a in r if a.timings.ttft is not None]
    return sum(vals) / len(vals) if vals else float("nan")


async def main(args: argparse.Namespace) -> int:
    document = Path(args.doc).read_text()
    # the shipped modules are trained for the team's base: with another --model, give --modules
    modules_dir = Path(args.modules) if args.modules else (MODULES if args.model is None else None)
    if args.model is None and args.modules is None and not args.url and TEAM_BASE.is_dir():
        args.model = str(TEAM_BASE)
    modules = ({p.name: p for p in sorted(modules_dir.iterdir()) if p.is_dir()}
               if modules_dir is not None and modules_dir.is_dir() else {})
    names = {name for name, _ in TEAM}
    served = {n: p for n, p in modules.items() if n in names}
    # trained modules with a recorded held-out accuracy: scored on episodes (a local server only)
    scored = {n: p for n, p in served.items() if (p / "heldout.json").is_file()} if args.episodes and not args.url else {}
    tmp = tempfile.TemporaryDirectory(prefix="agentshare-demo-")
    rounds = args.reps + 1  # the first is the untimed warm-up
    # fresh tenants for every repetition (so each prefills the report anew): one for the shared
    # arm, one per agent for the private arm; the client's own key serves the episodes
    client_key = f"demo-{secrets.token_hex(4)}"
    shared_keys = [f"demo-shared{i}-{secrets.token_hex(4)}" for i in range(rounds)]
    solo_keys = [[f"demo-{n}{i}-{secrets.token_hex(4)}" for n in names] for i in range(rounds)]
    docs = [document] * rounds
    if args.url:
        client = AsyncClient(args.url, api_key=args.api_key or None)
        if len(args.solo_key or []) != len(TEAM):
            print("with --url, give --api-key and three --solo-key (keys the server accepts)", file=sys.stderr)
            return 2
        # the server's tenants are the keys given: each repetition's report starts with its own line
        # instead, so that none reads another's cache
        shared_keys = [args.api_key or ""] * rounds
        solo_keys = [list(args.solo_key)] * rounds
        docs = [f"(run {secrets.token_hex(4)})\n{document}" for _ in range(rounds)]
        first_run: dict[str, float] = {}
    else:
        first_run = prepare(args.model, args.dtype)
        keys = [*shared_keys, *(k for ks in solo_keys for k in ks)]
        extra = [a for k in keys for a in ("--api-key", k)] + ["--log-level", "warning"]
        if scored:  # the same modules on their own prefills, for the episodes' second arm
            served = {**served, **team_episodes.own_copies(scored, Path(tmp.name))}
        client = AsyncClient(api_key=client_key, model=args.model, modules=served, dtype=args.dtype,
                             threads=args.threads, server_args=extra, startup_timeout=args.startup_timeout)
        print("starting a local agentshare server ...")
    agents = team(set(served), args.max_tokens)
    started = time.perf_counter()
    async with client:
        first_run["server start"] = time.perf_counter() - started
        base_url = client.base_url
        assert base_url is not None
        print(f"server {base_url}; agents served: {', '.join(s.name for s in await client.agents())}")
        print(f"base model: {args.model or 'the default model'}")
        print(f"shared context: {DOC.name if args.doc == str(DOC) else args.doc}")
        print(f"one untimed repetition of each arm, then {args.reps} of each, alternating:")
        ons: list[Run] = []
        offs: list[Run] = []
        for i in range(rounds):
            if i == 0:
                print("  (warm-up, not counted)")
            on = await sharing_on(base_url, shared_keys[i], docs[i], agents)
            off = await sharing_off(base_url, solo_keys[i], docs[i], agents)
            if i > 0:
                ons.append(on)
                offs.append(off)
        if scored:
            print(f"running the trained team on {args.episodes} held-out episodes, the arms alternating ...")
            assert modules_dir is not None
            episodes = await team_episodes.run(client, sorted(scored), args.episodes, _num_layers(args.model),
                                               modules_dir)
    print()
    for a in ons[0][0]:
        print(f"── {a.agent} ({a.module}) " + "─" * max(0, 60 - len(a.agent) - len(a.module)))
        print(a.text.strip() or "(empty)")
        print()
    print("per agent, sharing on:")
    print(ons[0][0].table(width=40))
    print()
    print(machine(args.url, args.dtype, first_run))
    print(report(ons, offs))
    print()
    print("sharing off = each agent in its own tenant (its own API key, so its own cache salt): the server\n"
          "prefills the whole report once per agent. Same server, same concurrent batched decoding, same\n"
          "prompts and greedy answers; the counters are the server's (agentshare_prefill_tokens_total).")
    if not served:
        print("\nno trained modules: all three agents run on the base model, so their answers show the\n"
              "plumbing, not specialised skills (examples/train_team.py trains them; docs/finetune.md).")
    same = all(a.text == b.text for a, b in zip(ons[0][0], offs[0][0], strict=True))
    print("\n" + numerics_note(same, args.dtype))
    if scored:
        print(f"\nthe trained team on {args.episodes} held-out episodes (generated scenarios: a table, chains of "
              "assignments and tool schemas; exact-match scoring):")
        print(episodes)
    tmp.cleanup()
    return 0


def _num_layers(model: str | None) -> int:
    from transformers import AutoConfig

    from server.models.patch import resolve_model_dir

    return int(AutoConfig.from_pretrained(resolve_model_dir(model)).num_hidden_layers)


def numerics_note(same: bool, dtype: str) -> str:
    """The closing line: whether sharing changed the answers, and why it may in bf16, with the
    agreement measured by benchmarks/bf16_agreement.py (three modules stepping together)."""
    head = f"answers identical with and without sharing: {'yes' if same else 'no'}."
    if dtype in ("float32", "fp32"):
        return head + ("" if same else " In fp32 the logits match to rounding, so only a near-tie can flip a token.")
    text = (" In bf16 (the default on CPUs that compute it natively) they may differ slightly without anything "
            "being wrong: a context read from the shared cache is summed in another order than one computed "
            "inside the request, which moves the logits by a rounding step, and greedy decoding can then pick "
            "another word where two were almost tied.")
    try:
        rec = json.loads(RECORDED.read_text())
        fig = rec["figures"]["batch3"]["base"]
        text += (f" Measured on the default model ({len(rec['records'])} prompts x {rec['tokens']} tokens, "
                 f"{RECORDED.relative_to(HERE.parent)}): shared and unshared bf16 pick the same next token "
                 f"{fig['shared~cold']['top1_agreement']:.1%} of the time, unshared bf16 and fp32 "
                 f"{fig['cold~fp32']['top1_agreement']:.1%}.")
    except (OSError, KeyError, ValueError):
        pass  # the recorded run is not there (an installed copy of the demo): say it without figures
    return textwrap.fill(head + text + " In fp32 (--dtype float32) shared and unshared logits agree to rounding.",
                         width=100)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--doc", default=str(DOC), help="the shared context (a text file)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each agent generates")
    p.add_argument("--reps", type=int, default=3,
                   help="timed repetitions of each arm, alternating, after one untimed warm-up of each")
    p.add_argument("--model", default=None,
                   help="base model directory or base patch (default: the shipped team's base, examples/modules/"
                        "team-base, a patch of SmolLM2-135M-Instruct; without it, the default model)")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the launched server")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--url", default=None, help="use a running server instead of launching one")
    p.add_argument("--api-key", default=None, help="with --url: the shared arm's key")
    p.add_argument("--solo-key", action="append", help="with --url: one key per agent for the sharing-off arm")
    p.add_argument("--modules", default=None,
                   help="directory of trained modules, one per agent (default: examples/modules/ with the default model)")
    p.add_argument("--episodes", type=int, default=12,
                   help="held-out episodes the trained team is scored on (0: skip; a launched server only)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(anyio.run(main, parse()))
