"""The fidelity table: does a cache-conditioned module on the base's KV stay as good as its own fine-tune?

Per task, accuracy on a held-out split of:

1. ``base``      the base model, prompted (decoding from its own = the shared prefill);
2. ``standard``  a standard LoRA fine-tune, served with its own prefill;
3. ``naive``     that standard LoRA served from the base's KV (naive sharing);
4. ``cache``     the cache-conditioned LoRA module served from the base's KV (agentshare);
5. ``full``      a cache-conditioned full module from the base's KV (``--full``).

Paired bootstrap intervals for (4)-(2) and (3)-(2) on the same examples. With ``--engine`` the
base, standard and cache-conditioned arms are evaluated again through the serving engine (bf16).
Modules and results are kept under ``--out``; a rerun skips what is done (so a long run can be resumed task by task)::

    OMP_NUM_THREADS=1 python benchmarks/fidelity.py --tasks retrieval --train 800 --eval 300 \\
        --out runs/fidelity --threads 1 --autocast
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch

from server.models.loader import default_model_dir
from server.modules.manifest import ModuleKind
from server.training.dataset import parse_row, write_jsonl
from server.training.evaluate import (
    Arm,
    accuracy,
    answers,
    engine_answers,
    load_split,
    paired_bootstrap,
)
from server.training.tasks import KEYS, Difficulty, generate, retrieval_error
from server.training.trainer import FinetuneConfig, finetune

MAX_NEW = {"retrieval": 12, "planning": 8, "tool": 48}


def run_task(task: str, a: argparse.Namespace, base: Path) -> dict:
    d = Path(a.out) / task
    d.mkdir(parents=True, exist_ok=True)
    result_path = d / "result.json"
    if result_path.is_file():
        return json.loads(result_path.read_text())
    diff = Difficulty(records=a.records, chains=a.chains, chain_length=a.chain_length, tools=a.tools, key=a.key)
    train = write_jsonl(generate(task, a.train, seed=0, difficulty=diff), d / "train.jsonl")
    held = generate(task, a.eval, seed=1, difficulty=diff)
    write_jsonl(held, d / "eval.jsonl")
    common = dict(base=base, data=train, rank=a.rank, alpha=a.alpha, target_modules=tuple(a.targets),
                  epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, seed=a.seed, autocast=a.autocast,
                  kv_dtype="bfloat16", threads=a.threads, progress=not a.quiet)
    trained = {}
    kinds = [("standard", False, ModuleKind.LORA), ("cache", True, ModuleKind.LORA)]
    if a.full:
        kinds.append(("full", True, ModuleKind.FULL))
    for name, cc, kind in kinds:
        out = d / name
        if not (out / "training.json").is_file():
            epochs = a.cache_epochs if cc and a.cache_epochs is not None else a.epochs
            finetune(FinetuneConfig(output=out, name=f"{task}-{name}", kind=kind, cache_conditioned=cc,
                                    **{**common, "epochs": epochs,
                                       "lr": a.full_lr if kind is ModuleKind.FULL else a.lr}))
        trained[name] = json.loads((out / "training.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    std = load_split(base, d / "standard", autocast=a.autocast)
    arms = {"base": Arm(load_split(base, autocast=a.autocast), shared=True),
            "standard": Arm(std, shared=False), "naive": Arm(std, shared=True),
            "cache": Arm(load_split(base, d / "cache", autocast=a.autocast), shared=True)}
    if a.full:
        arms["full"] = Arm(load_split(base, d / "full", autocast=a.autocast), shared=True)
    examples = [parse_row(r, line=i + 1) for i, r in enumerate(held)]
    t0 = time.perf_counter()
    preds = answers(arms, examples, tok, batch_size=a.eval_batch, max_new_tokens=MAX_NEW[task],
                    progress=not a.quiet)
    correct = {k: accuracy(task, v, examples) for k, v in preds.items()}
    res = {
        "task": task, "difficulty": dataclasses.asdict(diff),
        "train_examples": a.train, "eval_examples": a.eval,
        "accuracy": {k: sum(v) / len(v) for k, v in correct.items()},
        "cache_minus_standard": paired_bootstrap(correct["cache"], correct["standard"]),
        "naive_minus_standard": paired_bootstrap(correct["naive"], correct["standard"]),
        "training": {k: {"steps": v["steps"], "seconds": v["seconds"], "final_loss": v["final_loss"]}
                     for k, v in trained.items()},
        "eval_seconds": round(time.perf_counter() - t0, 1),
        "samples": [{"reference": ex.response, **{k: preds[k][i] for k in preds}}
                    for i, ex in enumerate(examples[:8])],
    }
    if a.full:
        res["full_minus_standard"] = paired_bootstrap(correct["full"], correct["standard"])
    (d / "predictions.json").write_text(json.dumps({"correct": correct, "predictions": preds}))
    result_path.write_text(json.dumps(res, indent=2))
    return res


def held_out_rows(d: Path) -> list[dict]:
    """The task's held-out rows (JSON objects), as written by :func:`run_task`."""
    return [json.loads(line) for line in (d / "eval.jsonl").read_text().splitlines()]


def held_out(d: Path) -> list:
    """The task's held-out examples, parsed."""
    return [parse_row(r, line=i + 1) for i, r in enumerate(held_out_rows(d))]


def error_kinds(task: str, a: argparse.Namespace) -> dict:
    """Retrieval only: each arm's wrong answers by kind (:func:`server.training.tasks.retrieval_error`),
    from the stored predictions; kept in the task's result under ``errors``."""
    d = Path(a.out) / task
    res = json.loads((d / "result.json").read_text())
    if task != "retrieval" or "errors" in res:
        return res
    rows = held_out_rows(d)
    preds = json.loads((d / "predictions.json").read_text())["predictions"]
    res["errors"] = {arm: dict(collections.Counter(k for k in (retrieval_error(r, p) for r, p in zip(rows, v, strict=True)) if k))
                     for arm, v in preds.items()}
    (d / "result.json").write_text(json.dumps(res, indent=2))
    return res


def run_engine(task: str, a: argparse.Namespace, base: Path) -> dict:
    """The arms again, through the serving engine (bf16, as the modules' family says): the base,
    the standard module (no manifest: its own prefill) and the cache-conditioned one (the
    base's shared prefill). Stored in the task's result under ``engine``."""
    d = Path(a.out) / task
    res = json.loads((d / "result.json").read_text())
    if "engine" in res:
        return res
    examples = held_out(d)
    modules = {name: d / name for name in ("standard", "cache", "full") if (d / name / "training.json").is_file()}
    t0 = time.perf_counter()
    preds = engine_answers(base, modules, examples, dtype="bfloat16", max_new_tokens=MAX_NEW[task],
                           threads=a.threads, progress=not a.quiet)
    correct = {k: accuracy(task, v, examples) for k, v in preds.items()}
    ref = json.loads((d / "predictions.json").read_text())
    res["engine"] = {
        "accuracy": {k: sum(v) / len(v) for k, v in correct.items()},
        "cache_minus_standard": paired_bootstrap(correct["cache"], correct["standard"]),
        "agreement_with_reference": {k: sum(x == y for x, y in zip(v, ref["predictions"][k], strict=True)) / len(v)
                                     for k, v in preds.items() if k in ref["predictions"]},
        "eval_seconds": round(time.perf_counter() - t0, 1),
    }
    (d / "result.json").write_text(json.dumps(res, indent=2))
    return res


VARIANT_KNOBS = {"lr": float, "rank": int, "alpha": float, "epochs": float, "recompute": int, "layers": int}


def parse_variant(text: str) -> dict:
    """``"lr=3e-3,rank=64"`` -> ``{"lr": 0.003, "rank": 64}`` (FinetuneConfig overrides of a
    cache-conditioned LoRA module)."""
    out = {}
    for part in filter(None, text.split(",")):
        knob, _, value = part.partition("=")
        if knob not in VARIANT_KNOBS or not value:
            raise SystemExit(f"bad variant {text!r}: use knob=value with knobs {', '.join(VARIANT_KNOBS)}")
        out[knob] = VARIANT_KNOBS[knob](value)
    return out


def train_and_score(task: str, a: argparse.Namespace, base: Path, name: str, overrides: dict) -> dict:
    """Train a cache-conditioned LoRA module of ``task`` with ``overrides`` (into ``out/task/name``)
    and score it on the held-out split, paired to arms (2) and (4)."""
    d = Path(a.out) / task
    from transformers import AutoTokenizer

    examples = held_out(d)
    ref = json.loads((d / "predictions.json").read_text())["correct"]
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    out = d / name
    if not (out / "training.json").is_file():
        cfg = {"rank": a.rank, "alpha": a.alpha, "epochs": a.epochs, "lr": a.lr, **overrides}
        finetune(FinetuneConfig(
            output=out, name=f"{task}-{name}", kind=ModuleKind.LORA, cache_conditioned=True, base=base,
            data=d / "train.jsonl", target_modules=tuple(a.targets), batch_size=a.batch_size, seed=a.seed,
            autocast=a.autocast, kv_dtype="bfloat16", threads=a.threads, progress=not a.quiet, **cfg))
    trained = json.loads((out / "training.json").read_text())
    k = trained["config"].get("recompute", 0)
    t0 = time.perf_counter()
    arm = Arm(load_split(base, out, autocast=a.autocast, recompute=k), shared=True)
    ok = accuracy(task, answers({name: arm}, examples, AutoTokenizer.from_pretrained(base),
                                batch_size=a.eval_batch, max_new_tokens=MAX_NEW[task])[name], examples)
    return {"overrides": overrides, "k": k, "layers": layers,
            "tuned_layers": trained["config"].get("layers") or layers, "prefill_saved": round(1 - k / layers, 4),
            "accuracy": sum(ok) / len(ok), "minus_standard": paired_bootstrap(ok, ref["standard"]),
            "minus_cache": paired_bootstrap(ok, ref["cache"]),
            "training": {x: trained[x] for x in ("steps", "seconds", "final_loss")},
            "eval_seconds": round(time.perf_counter() - t0, 1)}


def run_trained_recompute(task: str, a: argparse.Namespace, base: Path) -> dict:
    """Cache-conditioned LoRA modules trained *with* partial recompute of their top k layers
    (``FinetuneConfig(recompute=k)``), evaluated on the reference path, paired to (2) and (4).
    With ``--layer-split`` the module also tunes only those k layers (``layers=k``): below the
    split every position is the base's."""
    path = Path(a.out) / task / "trained_recompute.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    suffix = "-split" if a.layer_split else ""
    for k in (int(x) for x in a.train_recompute.split(",")):
        key = f"{k}{suffix}"
        if key not in done:
            overrides = {"recompute": k, **({"layers": k} if a.layer_split else {})}
            done[key] = train_and_score(task, a, base, f"cache-rc{key}", overrides)
            path.write_text(json.dumps(done, indent=2))
        print(task, f"trained recompute k={key}", f"acc={done[key]['accuracy']:.3f}", flush=True)
    return done


def run_variants(task: str, a: argparse.Namespace, base: Path) -> dict:
    """Cache-conditioned LoRA modules with other training settings (``--variant lr=3e-3``), paired
    to (2) and (4): does more capacity or another learning rate close the gap?"""
    path = Path(a.out) / task / "variants.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    for text in a.variant:
        overrides = parse_variant(text)
        key = ",".join(f"{k}={v}" for k, v in overrides.items())
        if key not in done:
            done[key] = train_and_score(task, a, base, "cache-" + key.replace("=", "").replace(",", "-"), overrides)
            path.write_text(json.dumps(done, indent=2))
        print(task, f"variant {key}", f"acc={done[key]['accuracy']:.3f}", flush=True)
    return done


def run_curve(task: str, a: argparse.Namespace, base: Path) -> dict:
    """Accuracy vs k (top layers whose prefix KV the module recomputes), eval only, paired to (2)."""
    d = Path(a.out) / task
    path = d / "curve.json"
    curve = json.loads(path.read_text()) if path.is_file() else {}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    examples = held_out(d)
    ref = json.loads((d / "predictions.json").read_text())["correct"]["standard"]
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    for module in a.curve_modules:
        for k in (int(x) for x in a.curve.split(",")):
            key = f"{module}@{k}"
            if key in curve:
                continue
            t0 = time.perf_counter()
            arm = Arm(load_split(base, d / module, autocast=a.autocast, recompute=k), shared=True)
            preds = answers({key: arm}, examples, tok, batch_size=a.eval_batch,
                            max_new_tokens=MAX_NEW[task])[key]
            ok = accuracy(task, preds, examples)
            curve[key] = {"module": module, "k": k, "layers": layers, "accuracy": sum(ok) / len(ok),
                          "prefill_saved": round(1 - k / layers, 4),
                          "minus_standard": paired_bootstrap(ok, ref),
                          "eval_seconds": round(time.perf_counter() - t0, 1)}
            path.write_text(json.dumps(curve, indent=2))
            print(task, key, f"acc={curve[key]['accuracy']:.3f}", flush=True)
    return curve


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _ci(d: dict) -> str:
    return f"{100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"


def report(outs: list[str]) -> str:
    """Markdown tables of every finished task under the ``outs`` directories: the arms, and the
    trained-recompute modules and variants, each paired to (2)."""
    lines = ["| run / task | (1) base | (2) standard | (3) naive | (4) cache-conditioned | (4) − (2) | (3) − (2) |",
             "|---|---|---|---|---|---|---|"]
    extra = ["| run / task | module | prefill saved | accuracy | − (2) | − (4) | steps, training s, final loss |",
             "|---|---|---|---|---|---|---|"]
    for out in outs:
        for res_path in sorted(Path(out).glob("*/result.json")):
            r, d = json.loads(res_path.read_text()), res_path.parent
            acc, name = r["accuracy"], f"{Path(out).name} / {r['task']}"
            lines.append(f"| {name} | " + " | ".join(_pct(acc[k]) for k in ("base", "standard", "naive", "cache"))
                         + f" | {_ci(r['cache_minus_standard'])} | {_ci(r['naive_minus_standard'])} |")
            for file in ("trained_recompute.json", "variants.json"):
                for key, v in (json.loads((d / file).read_text()) if (d / file).is_file() else {}).items():
                    module = f"k = {key}" if file.startswith("trained") else key
                    t = v["training"]
                    extra.append(f"| {name} | {module} | {_pct(v['prefill_saved'])} | {_pct(v['accuracy'])} | "
                                 f"{_ci(v['minus_standard'])} | {_ci(v['minus_cache'])} | "
                                 f"{t['steps']}, {t['seconds']:.0f}, {t['final_loss']:.3f} |")
    return "\n".join(lines + [""] + extra)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="retrieval,planning,tool")
    p.add_argument("--train", type=int, default=800)
    p.add_argument("--eval", type=int, default=300)
    p.add_argument("--records", type=int, default=8)
    p.add_argument("--chains", type=int, default=3)
    p.add_argument("--chain-length", type=int, default=3)
    p.add_argument("--tools", type=int, default=3)
    p.add_argument("--key", default="name", choices=KEYS,
                   help="how a retrieval question names its record: by name, or by role and team together")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--full", action="store_true", help="also train a cache-conditioned full module")
    p.add_argument("--full-lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--cache-epochs", type=float, default=None,
                   help="epochs of the cache-conditioned arms (default: --epochs); its steps are ~2x "
                        "cheaper, so 2 epochs is about the standard arm's compute")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--autocast", action="store_true", help="bf16 matmuls (CPU autocast)")
    p.add_argument("--base", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="runs/fidelity")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--engine", action="store_true", help="also evaluate the arms through the serving engine")
    p.add_argument("--curve", default="", help="k values (e.g. 2,8,15): partial-recompute curve")
    p.add_argument("--curve-modules", nargs="+", default=["standard", "cache"])
    p.add_argument("--train-recompute", default="",
                   help="k values (e.g. 8,15): train cache-conditioned modules that recompute their top k layers")
    p.add_argument("--variant", action="append", default=[],
                   help="a cache-conditioned LoRA with other settings, e.g. lr=3e-3 or rank=64,alpha=128 "
                        "(repeatable; knobs: " + ", ".join(VARIANT_KNOBS) + ")")
    p.add_argument("--layer-split", action="store_true",
                   help="with --train-recompute: the modules tune only their top k layers (the layer split)")
    p.add_argument("--report", nargs="+", metavar="OUT",
                   help="print markdown tables of the finished runs under these --out directories, and exit")
    a = p.parse_args()
    if a.report:
        print(report(a.report))
        return
    torch.set_num_threads(a.threads)
    base = Path(a.base) if a.base else default_model_dir()
    results = [run_task(t, a, base) for t in a.tasks.split(",")]
    results = [error_kinds(r["task"], a) for r in results]
    if a.engine:
        results = [run_engine(r["task"], a, base) for r in results]
    curves = {t: run_curve(t, a, base) for t in a.tasks.split(",")} if a.curve else {}
    trained_curves = ({t: run_trained_recompute(t, a, base) for t in a.tasks.split(",")}
                      if a.train_recompute else {})
    variants = {t: run_variants(t, a, base) for t in a.tasks.split(",")} if a.variant else {}
    summary = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": a.threads,
                           "cores_visible": os.cpu_count(), "torch": torch.__version__,
                           "autocast_bf16": a.autocast},
               "args": vars(a), "results": results, "curves": curves, "trained_recompute": trained_curves, "variants": variants}
    Path(a.out, "fidelity.json").write_text(json.dumps(summary, indent=2))
    for r in results:
        acc = r["accuracy"]
        print(r["task"], " ".join(f"{k}={v:.3f}" for k, v in acc.items()),
              "cache-standard={diff:+.3f} [{lo:+.3f},{hi:+.3f}]".format(**r["cache_minus_standard"]))
        for arm, kinds in r.get("errors", {}).items():
            print(f"{r['task']} {arm} errors:", ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none")
        if "engine" in r:
            e = r["engine"]
            print(f"{r['task']} (engine)", " ".join(f"{k}={v:.3f}" for k, v in e["accuracy"].items()),
                  "cache-standard={diff:+.3f} [{lo:+.3f},{hi:+.3f}]".format(**e["cache_minus_standard"]))


if __name__ == "__main__":
    main()
