"""Arm (6) of the fidelity study, small: does a jointly trained prefill module let a decode module
read the shared prefix at full sharing (k = 0) as well as the layer split does?

1. ``finetune-joint`` on the team's mixture (the episodes of ``examples/train_team.py``:
   retrieval, planning, tool), a short budget (``--joint-epochs``), merged into a new base;
2. a cache-conditioned decode module of ``--task`` on that base, at k = 0, trained as the
   shipped one was (rank 8, one epoch, the same rows);
3. both through the engine (bf16) on the same held-out episodes as the shipped module's record,
   paired: the joint arm at full sharing, the same module on its own prefill, and the shipped
   module (on the base it ships with, at its layer split), with paired bootstrap intervals.

    python benchmarks/joint_prefill.py --task retrieval --json benchmarks/recorded/joint_prefill_retrieval.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path

from server.models.loader import default_model_dir
from server.modules.manifest import MANIFEST_FILE
from server.training.dataset import write_jsonl
from server.training.evaluate import accuracy, engine_answers, paired_bootstrap
from server.training.joint import JointConfig, train_joint
from server.training.tasks import generate
from server.training.trainer import FinetuneConfig, finetune

ROOT = Path(__file__).resolve().parents[1]


def team_script():
    spec = importlib.util.spec_from_file_location("train_team", ROOT / "examples" / "train_team.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="retrieval", help="the agent whose decode module is compared")
    p.add_argument("--joint-epochs", type=float, default=0.5)
    p.add_argument("--eval", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default=None, help="keep the joint base and module here (default: a temp dir)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    team = team_script()
    agent = a.task
    task, _, n_train = team.TEAM[agent]
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="joint-"))
    base = default_model_dir()
    rows = [r for name, (t, _, n) in team.TEAM.items()
            for r in generate(t, n, seed=team.TRAIN_SEED, difficulty=team.SCENARIO)]
    mix = write_jsonl(rows, work / "mixture.jsonl")
    joint_dir = work / "joint-base"
    if not (joint_dir / "agentshare-joint.json").is_file():
        train_joint(JointConfig(base=base, data=mix, output=joint_dir, epochs=a.joint_epochs, rank=16, alpha=32,
                                decode_rank=team.RANK, autocast=True, threads=a.threads, kv_dtype="bfloat16"))
    joint = json.loads((joint_dir / "agentshare-joint.json").read_text())
    module = work / f"{agent}-joint"
    if not (module / "training.json").is_file():
        data = write_jsonl(generate(task, n_train, seed=team.TRAIN_SEED, difficulty=team.SCENARIO),
                           work / f"{agent}.jsonl")
        finetune(FinetuneConfig(base=joint_dir, data=data, output=module, name=agent, rank=team.RANK,
                                alpha=team.ALPHA, epochs=1, batch_size=8, lr=1e-3, seed=team.TRAIN_SEED,
                                kv_dtype="bfloat16", autocast=True, threads=a.threads))
    trained = json.loads((module / "training.json").read_text())
    own = work / f"{agent}-joint-own"
    shutil.copytree(module, own, ignore=shutil.ignore_patterns(MANIFEST_FILE), dirs_exist_ok=True)
    examples = team.held_out(task, a.eval)
    t0 = time.perf_counter()
    preds = engine_answers(joint_dir, {"joint": module, "joint_own": own}, examples, dtype="bfloat16",
                           max_new_tokens=team.MAX_NEW[task], threads=a.threads, include_base=True)
    shipped_dir = ROOT / "examples" / "modules" / agent
    shipped = engine_answers(team.team_base(), {"shipped": shipped_dir}, examples, dtype="bfloat16",
                             max_new_tokens=team.MAX_NEW[task], threads=a.threads, include_base=True)
    correct = {k: accuracy(task, v, examples) for k, v in {**preds, **shipped}.items()}
    record = json.loads((shipped_dir / "heldout.json").read_text())
    res = {
        "task": task, "eval_examples": a.eval, "held_out_seed": team.HELD_OUT_SEED,
        "accuracy": {k: sum(v) / len(v) for k, v in correct.items()},
        "joint_minus_shipped": paired_bootstrap(correct["joint"], correct["shipped"]),
        "joint_minus_joint_own": paired_bootstrap(correct["joint"], correct["joint_own"]),
        "shipped_recompute_layers": record["recompute_layers"],
        "joint_training": {k: joint[k] for k in ("steps", "examples", "seconds", "final_loss", "tasks")},
        "decode_training": {"steps": trained["steps"], "seconds": trained["seconds"],
                            "final_loss": trained["final_loss"]},
        "eval_seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(res["accuracy"], indent=2), json.dumps(res["joint_minus_shipped"]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
