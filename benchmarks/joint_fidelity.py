"""Arms (6) and (7) of the fidelity study at the study's settings, paired to arm (2) on 600+
held-out examples: does a jointly trained prefill module close the gap of full sharing?

Settings (the study's, ``docs/finetune.md``): retrieval by name over 16 records, retrieval by
role and team over 8 records, planning over 3 chains of 3. Per setting, through the engine (bf16):

- (2) ``standard``: a standard LoRA on the original base, served on its own prefill;
- (2') ``standard-equal``: the same, trained on its rows plus the joint mixture's rows of the
  setting (``--raw-arms standard-equal``): a joint arm's whole exposure to the task, so that a
  joint arm that beats (2) is not credited with rows (2) never saw;
- (4) ``cache``: a cache-conditioned LoRA on the original base, at full sharing (k = 0);
- (6) ``joint``: a cache-conditioned LoRA on the jointly trained base, at full sharing;
- (7) ``joint-k<k>``: the same, trained and served with its top k layers recomputed (``--k``).

The joint base: ``finetune-joint`` on a mixture of every setting plus tool calling (3 tools),
drawn from a seed of its own (``--joint-seed``: neither the decode modules' training rows nor
the held-out ones), for a short budget (``--joint-epochs`` of the mixture), merged into a new
base (a new family). Every module has the study's recipe: rank 16, alpha 32, all projections,
one epoch of 800 rows, lr 1e-3, batch 8, bf16 autocast.

Each stage keeps what it made under ``--out`` and is skipped when rerun, so the stages can run
in separate processes (one thread each on a small machine)::

    python benchmarks/joint_fidelity.py --stage joint              # the joint base
    python benchmarks/joint_fidelity.py --stage raw                # (2) and (4), every setting
    python benchmarks/joint_fidelity.py --stage shared             # (6), after the joint base
    python benchmarks/joint_fidelity.py --stage recompute --k team8=8,15
    python benchmarks/joint_fidelity.py --stage report --json benchmarks/recorded/joint_fidelity.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import platform
import shutil
import time
from pathlib import Path

import torch

from server.models.loader import default_model_dir
from server.modules.manifest import MANIFEST_FILE
from server.training.dataset import parse_row, write_jsonl
from server.training.evaluate import accuracy, engine_answers, paired_bootstrap
from server.training.joint import RECORD, JointConfig, train_joint
from server.training.tasks import Difficulty, generate, retrieval_error
from server.training.trainer import FinetuneConfig, finetune

SETTINGS = {  # name -> (task, difficulty); the study's scenario is 8 records, 3 chains of 3, 3 tools
    "name16": ("retrieval", Difficulty(records=16, chains=3, chain_length=3, tools=3, key="name")),
    "team8": ("retrieval", Difficulty(records=8, chains=3, chain_length=3, tools=3, key="role+team")),
    "planning": ("planning", Difficulty(records=8, chains=3, chain_length=3, tools=3)),
}
MIXABLE = {**SETTINGS, "tool": ("tool", Difficulty(records=8, chains=3, chain_length=3, tools=3))}
"""What the joint stage's mixture may hold: every setting, and tool calling."""
MAX_NEW = {"retrieval": 12, "planning": 8, "tool": 48}
TRAIN_SEED, HELD_OUT_SEED = 0, 1


def module_config(a: argparse.Namespace, base: Path, data: Path, out: Path, name: str, **kw) -> FinetuneConfig:
    return FinetuneConfig(base=base, data=data, output=out, name=name, rank=16, alpha=32.0, epochs=1.0,
                          batch_size=8, lr=1e-3, seed=0, kv_dtype="bfloat16", autocast=True,
                          threads=a.threads, progress=not a.quiet, **kw)


def original_base(a: argparse.Namespace) -> Path:
    return Path(a.base) if a.base else default_model_dir()


def setting_dir(a: argparse.Namespace, setting: str) -> Path:
    """The setting's directory with its training and held-out rows (written once)."""
    task, diff = SETTINGS[setting]
    d = Path(a.out) / setting
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "train.jsonl").is_file():
        write_jsonl(generate(task, a.train, seed=TRAIN_SEED, difficulty=diff), d / "train.jsonl")
    if not (d / "eval.jsonl").is_file():
        write_jsonl(generate(task, a.eval, seed=HELD_OUT_SEED, difficulty=diff), d / "eval.jsonl")
    return d


def train(out: Path, cfg: FinetuneConfig) -> None:
    """Fine-tune ``cfg`` into ``out`` unless it is there already."""
    if not (out / "training.json").is_file():
        finetune(cfg)


def held_out_rows(d: Path) -> list[dict]:
    """The setting's held-out rows, as :func:`setting_dir` wrote them."""
    return [json.loads(line) for line in (d / "eval.jsonl").read_text().splitlines()]


def evaluate(a: argparse.Namespace, setting: str, base: Path, modules: dict[str, Path]) -> None:
    """Engine answers of ``modules`` (served on ``base``) to the held-out rows, kept in
    ``predictions.json`` by arm; arms already there are not run again."""
    d = setting_dir(a, setting)
    path = d / "predictions.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    todo = {k: v for k, v in modules.items() if k not in done}
    if not todo:
        return
    task = SETTINGS[setting][0]
    examples = [parse_row(r, line=i + 1) for i, r in enumerate(held_out_rows(d))]
    t0 = time.perf_counter()
    preds = engine_answers(base, todo, examples, dtype="bfloat16", max_new_tokens=MAX_NEW[task],
                           threads=a.threads, include_base=False, progress=not a.quiet)
    seconds = round(time.perf_counter() - t0, 1)
    done = json.loads(path.read_text()) if path.is_file() else {}  # another stage may have written
    for k, v in preds.items():
        done[k] = {"predictions": v, "correct": accuracy(task, v, examples), "eval_seconds": seconds}
    path.write_text(json.dumps(done))


def joint_mix(a: argparse.Namespace) -> list[str]:
    """The settings (and ``tool``) whose rows make the joint stage's mixture."""
    return [s for s in a.joint_mix.split(",") if s]


def joint_name(a: argparse.Namespace) -> str:
    """``joint`` for the whole mixture, ``joint-<settings>`` for another (its base and its arms)."""
    if a.joint_name:
        return a.joint_name
    mix = joint_mix(a)
    return "joint" if mix == list(MIXABLE) else "joint-" + "+".join(mix)


def joint_base(a: argparse.Namespace) -> Path:
    out = Path(a.out) / f"{joint_name(a)}-base"
    if (out / RECORD).is_file():
        return out
    rows = []
    for setting in joint_mix(a):
        task, diff = MIXABLE[setting]
        # each setting trains a decode adapter of its own during the joint stage
        rows += [{**r, "task": setting} for r in generate(task, a.joint_rows, seed=a.joint_seed, difficulty=diff)]
    mix = write_jsonl(rows, Path(a.out) / f"{joint_name(a)}-mixture.jsonl")
    train_joint(JointConfig(base=original_base(a), data=mix, output=out, epochs=a.joint_epochs, rank=16,
                            alpha=32.0, decode_rank=8, autocast=True, threads=a.threads, kv_dtype="bfloat16",
                            seed=0, progress=not a.quiet))
    return out


RAW_ARMS = ("standard", "cache", "standard-equal")
"""The raw stage's arms on the original base: (2), (4) and (2')."""


def equal_rows(a: argparse.Namespace, setting: str) -> Path:
    """Arm (2')'s rows: the setting's training rows, then the joint mixture's rows of it (the
    same ``--joint-rows`` of ``--joint-seed`` that :func:`joint_base` draws)."""
    d = setting_dir(a, setting)
    path = d / f"train-equal-{a.joint_rows}-{a.joint_seed}.jsonl"
    if not path.is_file():
        task, diff = SETTINGS[setting]
        rows = [json.loads(line) for line in (d / "train.jsonl").read_text().splitlines()]
        write_jsonl(rows + generate(task, a.joint_rows, seed=a.joint_seed, difficulty=diff), path)
    return path


def stage_raw(a: argparse.Namespace, setting: str) -> None:
    d, base = setting_dir(a, setting), original_base(a)
    arms = a.raw_arms.split(",")
    for arm in arms:
        kw = {} if arm == "cache" else dict(cache_conditioned=False)
        data = equal_rows(a, setting) if arm == "standard-equal" else d / "train.jsonl"
        train(d / arm, module_config(a, base, data, d / arm, f"{setting}-{arm}", **kw))
    evaluate(a, setting, base, {arm: d / arm for arm in arms})


def stage_shared(a: argparse.Namespace, setting: str, k: int = 0) -> None:
    d, base = setting_dir(a, setting), joint_base(a)
    name = joint_name(a) if k == 0 else f"{joint_name(a)}-k{k}"
    train(d / name, module_config(a, base, d / "train.jsonl", d / name, f"{setting}-{name}", recompute=k))
    own = {}
    if k == 0 and a.own:  # the same module on its own prefill: how much of the arm is the joint base itself
        own = {f"{name}-own": d / f"{name}-own"}
        if not (d / f"{name}-own" / "training.json").is_file():
            shutil.copytree(d / name, d / f"{name}-own", ignore=shutil.ignore_patterns(MANIFEST_FILE),
                            dirs_exist_ok=True)
    evaluate(a, setting, base, {name: d / name, **own})


def report(a: argparse.Namespace) -> dict:
    layers = json.loads((original_base(a) / "config.json").read_text())["num_hidden_layers"]
    out: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": a.threads,
                             "torch": torch.__version__},
                 "settings": {s: {"task": t, **dataclasses.asdict(diff)} for s, (t, diff) in SETTINGS.items()},
                 "train_rows": a.train, "held_out": a.eval, "results": {}}
    out["joint_bases"] = {}
    for jb in sorted(Path(a.out).glob("joint*-base/" + RECORD)):
        j = json.loads(jb.read_text())
        rec = {k: j[k] for k in ("steps", "examples", "seconds", "final_loss", "tasks", "family") if k in j}
        out["joint_bases"][jb.parent.name.removesuffix("-base")] = {**rec, "epochs": j["config"]["epochs"]}
    for setting in SETTINGS:
        d = Path(a.out) / setting
        path = d / "predictions.json"
        if not path.is_file():
            continue
        preds = json.loads(path.read_text())
        res: dict = {"accuracy": {}, "minus_standard": {}, "minus_cache": {}, "minus_equal": {}, "training": {},
                     "eval_seconds": {}}
        for arm, v in preds.items():
            res["accuracy"][arm] = sum(v["correct"]) / len(v["correct"])
            res["eval_seconds"][arm] = v["eval_seconds"]
            if arm != "standard" and "standard" in preds:
                res["minus_standard"][arm] = paired_bootstrap(v["correct"], preds["standard"]["correct"])
            if (d / arm / "training.json").is_file() and not arm.endswith("-own"):
                t = json.loads((d / arm / "training.json").read_text())
                res["training"][arm] = {k: t[k] for k in ("steps", "seconds", "final_loss")}
                k = t["config"].get("recompute", 0)
                if t["config"].get("cache_conditioned", True):  # a standard module prefills on its own: saves none
                    res["training"][arm]["prefill_saved_3_agents"] = round(1 - (layers + 2 * k) / (3 * layers), 4)
        if SETTINGS[setting][0] == "retrieval":  # each arm's wrong answers by kind
            rows = held_out_rows(d)
            res["errors"] = {arm: dict(collections.Counter(
                e for e in (retrieval_error(r, x) for r, x in zip(rows, v["predictions"], strict=True)) if e))
                for arm, v in preds.items()}
        if "cache" in preds:  # what the joint base changes at the same k = 0 (and what k adds)
            res["minus_cache"] = {arm: paired_bootstrap(v["correct"], preds["cache"]["correct"])
                                  for arm, v in preds.items() if arm not in ("standard", "cache")}
        if "standard-equal" in preds:  # the joint arms against a standard module of the same exposure
            res["minus_equal"] = {arm: paired_bootstrap(v["correct"], preds["standard-equal"]["correct"])
                                  for arm, v in preds.items() if arm.startswith("joint")}
        out["results"][setting] = res
    return out


def table(r: dict) -> str:
    lines = ["| setting | arm | accuracy | − (2), 95 % CI | training steps, s, final loss |", "|---|---|---:|---|---|"]
    for setting, res in r["results"].items():
        for arm, acc in res["accuracy"].items():
            d = res["minus_standard"].get(arm)
            ci = f"{100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]" if d else ""
            t = res["training"].get(arm)
            tr = f"{t['steps']}, {t['seconds']:.0f}, {t['final_loss']:.3f}" if t else ""
            lines.append(f"| {setting} | {arm} | {100 * acc:.1f} % | {ci} | {tr} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", required=True, choices=["joint", "raw", "shared", "recompute", "report"])
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated: " + ", ".join(SETTINGS))
    p.add_argument("--k", default="", help="recompute stage: setting=k1,k2;setting=k (e.g. team8=8,15;name16=15)")
    p.add_argument("--train", type=int, default=800)
    p.add_argument("--eval", type=int, default=600)
    p.add_argument("--joint-rows", type=int, default=400, help="rows per setting (and tool) in the joint mixture")
    p.add_argument("--joint-epochs", type=float, default=0.5)
    p.add_argument("--joint-seed", type=int, default=2)
    p.add_argument("--joint-mix", default=",".join(MIXABLE),
                   help="the settings (and tool) of the joint mixture; another mixture is another base, "
                        "its arms named joint-<settings>")
    p.add_argument("--raw-arms", default="standard,cache",
                   help="raw stage: the arms on the original base, comma-separated: (2) standard, (4) cache, "
                        "(2') standard-equal (trained on the joint mixture's rows of the setting too: give the "
                        "joint base's --joint-rows and --joint-seed)")
    p.add_argument("--joint-name", default=None,
                   help="name of the joint base and its arms, for another budget of a mixture (default: from "
                        "the mixture)")
    p.add_argument("--no-own", dest="own", action="store_false",
                   help="shared stage: skip the module on its own prefill (its evaluation prefills every row)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--base", default=None, help="the original base (default: the default model)")
    p.add_argument("--out", default="runs/joint-fidelity")
    p.add_argument("--json", default=None)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    settings = [s for s in a.settings.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    unknown += [s for s in a.joint_mix.split(",") if s and s not in MIXABLE]
    if unknown:
        p.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    bad_arms = [arm for arm in a.raw_arms.split(",") if arm not in RAW_ARMS]
    if bad_arms or not a.raw_arms:
        p.error(f"unknown --raw-arms {', '.join(bad_arms) or '(none)'}; choose from {', '.join(RAW_ARMS)}")
    if a.stage == "joint":
        joint_base(a)
    elif a.stage == "raw":
        for s in settings:
            stage_raw(a, s)
    elif a.stage == "shared":
        for s in settings:
            stage_shared(a, s)
    elif a.stage == "recompute":
        for part in filter(None, a.k.split(";")):
            s, _, ks = part.partition("=")
            if s not in SETTINGS or not ks:
                p.error(f"bad --k part {part!r}: use setting=k1,k2 with a setting of {', '.join(SETTINGS)}")
            for k in ks.split(","):
                stage_shared(a, s, int(k))
    r = report(a)
    print(table(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
