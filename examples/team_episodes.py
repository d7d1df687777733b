"""The demo's second part: the trained team on held-out episodes, sharing on against each
module on its own prefill (used by ``three_agents.py``).

An episode is one generated scenario (``server/training/tasks.py``): a shared context holding a
table of records, chains of assignments and tool schemas, and one question per agent. The
episodes are drawn from a seed training never used. Per episode:

- sharing on: the context is prefilled once and pinned (``client.context``), then the three
  agents run concurrently on it (``ctx.fork``); a layer-split agent recomputes only its top
  layers over the context;
- own prefill: the same three modules, served without their manifests (``<agent>-own``): each
  request prefills the whole context with its module's weights, as a standalone fine-tune would.

The arms alternate episode by episode, after one untimed episode of each: the first calls of a
module set cost more, and a machine's load drifts, so timing one arm after the other would
charge either to one arm.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx

from agentshare import Agent, AsyncClient, Sampling, ServerMetrics
from server.modules.manifest import MANIFEST_FILE
from server.training.tasks import Difficulty, scenario, score

TASK = {"retrieval": "retrieval", "planning": "planning", "coding": "tool"}
MAX_NEW = {"retrieval": 12, "planning": 8, "tool": 48}
SCENARIO = Difficulty(records=8, chains=3, chain_length=3, tools=3)  # as the modules were trained
SEED = "team-demo"


def own_copies(modules: dict[str, Path], into: Path) -> dict[str, Path]:
    """``<agent>-own``: the same weights without a manifest, so the server gives them a private prefill."""
    out = {}
    for name, path in modules.items():
        dest = into / f"{name}-own"
        shutil.copytree(path, dest, ignore=shutil.ignore_patterns(MANIFEST_FILE), dirs_exist_ok=True)
        out[f"{name}-own"] = dest
    return out


@dataclass
class Arm:
    correct: dict[str, int]
    wall: float = 0.0
    computed: int = 0  # prompt positions prefilled (every layer, or the top ones of a split)
    split_prefix: int = 0  # of those, context positions a split agent recomputed over its top layers only
    split_saved: int = 0  # (position, layer) pairs those read from the shared prefill

    def add(self, wall: float, spent: ServerMetrics) -> None:
        self.wall += wall
        self.computed += spent.prefill_computed_tokens
        self.split_prefix += spent.split_prefix_tokens
        self.split_saved += spent.split_saved_layer_rows

    def work(self, num_layers: int) -> int:
        """The prefill work: (position, layer) pairs computed."""
        return self.computed * num_layers - self.split_saved


async def _shared(client: AsyncClient, sc: Any, agents: list[str], arm: Arm) -> None:
    """One episode, sharing on: the context pinned once, then the agents forked on it."""
    before, start = await client.metrics(), time.perf_counter()
    async with await client.context(sc.context) as ctx:
        tasks = [Agent(a, module=a, instruction=sc.questions[TASK[a]][0],
                       sampling=Sampling(max_tokens=MAX_NEW[TASK[a]], temperature=0)) for a in agents]
        answers = await ctx.fork(tasks)
    arm.add(time.perf_counter() - start, await client.metrics() - before)
    for a, answer in zip(agents, answers, strict=True):
        arm.correct[a] += score(TASK[a], answer.text, sc.questions[TASK[a]][1])


async def _own(client: AsyncClient, http: httpx.AsyncClient, sc: Any, agents: list[str], arm: Arm) -> None:
    """One episode, own prefills: each agent's request prefills the whole context itself."""
    before, start = await client.metrics(), time.perf_counter()

    async def ask(a: str) -> None:
        question, reference = sc.questions[TASK[a]]
        r = await http.post("/v1/chat/completions", json={
            "model": f"{a}-own", "temperature": 0, "max_tokens": MAX_NEW[TASK[a]],
            "messages": [{"role": "user", "content": sc.context}, {"role": "user", "content": question}]})
        r.raise_for_status()
        arm.correct[a] += score(TASK[a], r.json()["choices"][0]["message"]["content"] or "", reference)

    async with anyio.create_task_group() as tg:
        for a in agents:
            tg.start_soon(ask, a)
    arm.add(time.perf_counter() - start, await client.metrics() - before)


async def run(client: AsyncClient, agents: list[str], n: int, num_layers: int, modules_dir: Path) -> str:
    """Both arms on ``n`` episodes; the report as text."""
    episodes = [scenario(random.Random(f"{SEED}/{i}"), SCENARIO) for i in range(n)]
    url = client.base_url
    assert url is not None
    headers = {"Authorization": f"Bearer {client.api_key}"} if client.api_key else {}
    shared, own = Arm(dict.fromkeys(agents, 0)), Arm(dict.fromkeys(agents, 0))
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
        # one untimed episode of each arm first (its first calls of these modules), then the arms
        # alternate episode by episode, so neither pays the start-up costs or gets the machine's
        # quieter minutes
        warm = scenario(random.Random(f"{SEED}/warm-up"), SCENARIO)
        await _shared(client, warm, agents, Arm(dict.fromkeys(agents, 0)))
        await _own(client, http, warm, agents, Arm(dict.fromkeys(agents, 0)))
        for sc in episodes:
            await _shared(client, sc, agents, shared)
            await _own(client, http, sc, agents, own)
    rows = [("agent", "split", "sharing on", "own prefill", "recorded (held-out)")]
    for a in agents:
        rec = json.loads((modules_dir / a / "heldout.json").read_text())
        acc = rec["heldout"]["accuracy"]
        rows.append((f"{a} ({TASK[a]})", f"top {rec['recompute_layers']} of {num_layers}" if rec["recompute_layers"]
                     else "none", f"{shared.correct[a] / n:.0%}", f"{own.correct[a] / n:.0%}",
                     f"{acc['shared']:.1%} / {acc['own_prefill']:.1%} of {rec['heldout']['examples']}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths, strict=True)) for r in rows]

    w_on, w_off = shared.work(num_layers), own.work(num_layers)
    lines += [
        "",
        f"prefill work, (position x layer) pairs: sharing on {w_on:,}, own prefills {w_off:,}: "
        f"{1 - w_on / w_off:.0%} saved" if w_off else "",
        f"  sharing on: {shared.split_prefix:,} context positions recomputed over their top layers "
        f"only, {shared.split_saved:,} pairs read from the shared prefill",
        f"wall time for {n} episodes (the arms alternating, after one untimed episode each): sharing on "
        f"{shared.wall:.1f} s, own prefills {own.wall:.1f} s ({own.wall / shared.wall:.2f}x)" if shared.wall else "",
    ]
    return "\n".join(lines)
