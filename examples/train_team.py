"""Train the demo's team of specialists and record their held-out accuracy beside them.

    python examples/train_team.py                          # all three agents, one after another
    python examples/train_team.py --agents retrieval       # one of them (run two at once on two cores)

The team's base is a *joint base*: the default model (SmolLM2-135M-Instruct) with a prefill
adapter trained jointly for the family's tasks, shipped as a base patch in
``examples/modules/team-base/`` (9.4 MB; ``agentshare serve --model examples/modules/team-base``
builds the base once). Each agent is a LoRA module of that base, cache-conditioned on its bf16
KV at full sharing (no layer is recomputed), trained on generated episodes of its task
(``server/training/tasks.py``) and written to ``examples/modules/<agent>/``:

=============  ========  ============================================
agent          task      training rows
=============  ========  ============================================
retrieval      retrieval 800 (8 records, looked up by name)
planning       planning  400
coding         tool      400, and 800 of tool chat (below)
=============  ========  ============================================

The patch is the fidelity study's ``joint-team`` base (docs/finetune.md, "A joint base for the
whole team"): 100 steps on each of retrieval by name over 16 records, by role and team over 8,
planning and tool calling, all of another seed than the modules' training and held-out rows. On
the raw default model the retrieval agent needed its top 22 layers recomputed over the prefix to
match its own prefill; on the joint base it matches at full sharing.

The coding agent also learns OpenAI tool calling in the server's tool prompt format
(``server/training/tool_chat.py``): it calls a listed tool when one answers the question
(``tool_choice="auto"``), answers from the results, and answers plain text otherwise. Its
``heldout.json`` adds ``tool_chat``: held-out steps of that loop with the tools it was trained
on, and with tools it never saw.

Rank 8 on all seven projections, saved in bf16 (about 4.9 MB a module). Beside each module,
``heldout.json`` records its accuracy on held-out episodes through the engine, with the shared
prefill (as served) and on its own prefill (the same weights, no manifest), and how it was made;
``check`` is its accuracy on the first few of those episodes alone, which the tests reproduce
(``python examples/train_team.py --check`` records it again for the shipped modules).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout: the project's own packages

from server.models.patch import resolve_model_dir  # noqa: E402
from server.modules.manifest import MANIFEST_FILE  # noqa: E402
from server.training import tool_chat  # noqa: E402
from server.training.dataset import parse_row, write_jsonl  # noqa: E402
from server.training.evaluate import accuracy, engine_answers, paired_bootstrap  # noqa: E402
from server.training.tasks import Difficulty, generate  # noqa: E402
from server.training.trainer import FinetuneConfig, finetune  # noqa: E402

MODULES = HERE / "modules"
SCENARIO = Difficulty(records=8, chains=3, chain_length=3, tools=3)
"""The episodes' size: the fidelity study's first run (docs/finetune.md), about 400 tokens."""
BASE_PATCH = MODULES / "team-base"
"""The team's joint base, as a patch of the default model."""
TEAM = {  # agent -> (task, recompute_layers, training examples)
    "retrieval": ("retrieval", 0, 800),
    "planning": ("planning", 0, 400),
    "coding": ("tool", 0, 400),
}
MAX_NEW = {"retrieval": 12, "planning": 8, "tool": 48, tool_chat.TASK: 64}
TOOL_CHAT = {"coding": 800}
"""Agents that also learn OpenAI tool calling, and how many tool-chat rows they train on."""
TOOL_CHAT_EVAL = {"seen": 200, "unseen": 100}
CHECK = 24
"""Held-out episodes of the check the tests run (the first of the held-out set)."""
CHECK_THREADS = 2
"""Torch threads of the check, recorded and rerun alike: bf16 sums split across another number of
threads round differently, and a module near chance (planning) flips its near-ties."""
RANK, ALPHA = 8, 16.0
TRAIN_SEED, HELD_OUT_SEED = 0, 1


def team_base() -> Path:
    """The team's base model directory (the patch applied to the default model, built once)."""
    return resolve_model_dir(BASE_PATCH)


def held_out(task: str, n: int) -> list:
    """The held-out episodes of ``task`` (never trained on: another seed)."""
    return [parse_row(r, line=i + 1) for i, r in enumerate(generate(task, n, seed=HELD_OUT_SEED,
                                                                    difficulty=SCENARIO))]


def to_bf16(module_dir: Path) -> None:
    """Store the adapter in bf16 (the engine serves it in the base's dtype anyway)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = module_dir / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(path).items()}, path)


def evaluate(agent: str, module_dir: Path, n: int, threads: int) -> dict:
    """Held-out accuracy through the engine (bf16): shared prefill vs the module's own."""
    task = TEAM[agent][0]
    examples = held_out(task, n)
    with tempfile.TemporaryDirectory() as tmp:
        own = Path(tmp) / agent
        shutil.copytree(module_dir, own, ignore=shutil.ignore_patterns(MANIFEST_FILE))  # no manifest: private
        t0 = time.perf_counter()
        preds = engine_answers(team_base(), {"shared": module_dir, "own": own}, examples,
                               dtype="bfloat16", max_new_tokens=MAX_NEW[task], threads=threads,
                               include_base=False, progress=True)
    correct = {k: accuracy(task, v, examples) for k, v in preds.items()}
    out = {
        "examples": n, "seed": HELD_OUT_SEED,
        "accuracy": {"shared": sum(correct["shared"]) / n, "own_prefill": sum(correct["own"]) / n},
        "shared_minus_own": paired_bootstrap(correct["shared"], correct["own"]),
        "eval_seconds": round(time.perf_counter() - t0, 1),
    }
    if agent in TOOL_CHAT:
        out["tool_chat"] = {tools: evaluate_tool_chat(module_dir, n_rows, unseen=tools == "unseen", threads=threads)
                            for tools, n_rows in TOOL_CHAT_EVAL.items()}
    return out


def evaluate_tool_chat(module_dir: Path, n: int, *, unseen: bool, threads: int) -> dict:
    """Held-out tool-chat steps through the engine (bf16, greedy, no grammar), per kind of step:
    the module against the base model."""
    rows = tool_chat.generate(n, seed=HELD_OUT_SEED, unseen=unseen)
    examples = [parse_row(r, line=i + 1) for i, r in enumerate(rows)]
    preds = engine_answers(team_base(), {"module": module_dir}, examples, dtype="bfloat16",
                           max_new_tokens=MAX_NEW[tool_chat.TASK], threads=threads, include_base=True,
                           progress=True)
    out: dict = {"examples": n, "seed": HELD_OUT_SEED}
    for arm, texts in preds.items():
        by_kind: dict[str, list[bool]] = {}
        for text, row in zip(texts, rows, strict=True):
            by_kind.setdefault(row["kind"], []).append(tool_chat.score(text, row))
        out[arm] = {kind: {"correct": sum(v), "of": len(v)} for kind, v in sorted(by_kind.items())}
    return out


def check(agent: str, module_dir: Path, *, threads: int = CHECK_THREADS) -> dict:
    """The module's accuracy, served with the shared prefill, on the first :data:`CHECK` held-out
    episodes of its task, each with its base companion computing the shared context first (as in
    the team)."""
    task = TEAM[agent][0]
    examples = held_out(task, CHECK)
    preds = engine_answers(team_base(), {agent: module_dir}, examples, dtype="bfloat16",
                           max_new_tokens=MAX_NEW[task], threads=threads, include_base=True,
                           kv_cache_bytes=1 << 30)  # 48 requests of ~450 tokens: about 0.6 GiB of KV
    correct = accuracy(task, preds[agent], examples)
    return {"examples": CHECK, "seed": HELD_OUT_SEED, "accuracy": sum(correct) / CHECK,
            "correct": [int(c) for c in correct]}


def record_check(agent: str) -> None:
    path = MODULES / agent / "heldout.json"
    record = json.loads(path.read_text())
    record["check"] = check(agent, MODULES / agent)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{agent}: check {record['check']['accuracy']:.1%} of {CHECK}", flush=True)


def train(agent: str, a: argparse.Namespace) -> None:
    task, k, n_train = TEAM[agent]
    out = MODULES / agent
    with tempfile.TemporaryDirectory() as tmp:
        rows = generate(task, n_train, seed=TRAIN_SEED, difficulty=SCENARIO)
        rows += tool_chat.generate(TOOL_CHAT.get(agent, 0), seed=TRAIN_SEED)
        data = write_jsonl(rows, Path(tmp) / "train.jsonl")
        if out.exists():
            shutil.rmtree(out)
        result = finetune(FinetuneConfig(
            base=BASE_PATCH, data=data, output=out, name=agent, rank=RANK, alpha=ALPHA, epochs=1,
            batch_size=8, lr=1e-3, seed=TRAIN_SEED, kv_dtype="bfloat16", autocast=True, recompute=k,
            threads=a.threads))
    to_bf16(out)
    (out / "README.md").unlink(missing_ok=True)  # peft's empty model card
    record = {
        "agent": agent, "task": task, "recompute_layers": k, "rank": RANK, "alpha": ALPHA,
        "scenario": asdict(SCENARIO), "train_examples": n_train, "tool_chat_examples": TOOL_CHAT.get(agent, 0),
        "train_seed": TRAIN_SEED,
        "steps": result.steps, "train_seconds": round(result.seconds, 1),
        "command": f"python examples/train_team.py --agents {agent} --eval {a.eval}",
        "heldout": evaluate(agent, out, a.eval, a.threads),
    }
    (out / "heldout.json").write_text(json.dumps(record, indent=2) + "\n")
    record_check(agent)
    acc = record["heldout"]["accuracy"]
    print(f"{agent}: shared {acc['shared']:.1%}, own prefill {acc['own_prefill']:.1%} "
          f"({result.steps} steps, {result.seconds:.0f} s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", default=",".join(TEAM), help="which agents to train (comma-separated)")
    p.add_argument("--eval", type=int, default=300, help="held-out episodes per agent")
    p.add_argument("--threads", type=int, default=1, help="torch threads (run agents in parallel on more cores)")
    p.add_argument("--check", action="store_true",
                   help=f"only record the check of the shipped modules (on {CHECK_THREADS} threads, as the tests run it)")
    a = p.parse_args()
    for agent in a.agents.split(","):
        if agent not in TEAM:
            p.error(f"unknown agent {agent!r}; choose from {', '.join(TEAM)}")
        if a.check:
            record_check(agent)
        else:
            train(agent, a)


if __name__ == "__main__":
    main()
