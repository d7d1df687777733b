"""Sharing on task families a joint base never saw: a cache-conditioned module at full sharing
(k = 0) against a standard fine-tune on its own prefill, the same rows, per family and base.

For each family (``server/training/families.py``) and each base (``--base``, tagged ``--tag``):

- ``own``: ``finetune --standard`` (its own prefill);
- ``shared``: ``finetune`` (cache-conditioned, reads the base's KV of every layer);

both with the shipped team's recipe (LoRA r 8, alpha 16, all seven projections, one epoch,
lr 1e-3, batch 8, bf16 autocast), answered through the engine (bf16) on the same held-out rows
(seed 1; training rows seed 0; a joint mixture seed 2). Paired bootstrap CI of shared − own.

``--stage joint`` trains a broad joint base (``finetune-joint``) on every family but the held-out
ones, plus language modelling on the standard library's sources. Each stage keeps what it made
under ``--out`` and skips it when rerun, so stages can run in separate processes::

    python benchmarks/heldout_families.py --tag before --families prose-records,counting
    python benchmarks/heldout_families.py --stage joint --hold-out prose-records,counting,...
    python benchmarks/heldout_families.py --tag after --base OUT/joint/patch --families ...
    python benchmarks/heldout_families.py --stage perplexity --bases default=,team=...,joint=OUT/joint
    python benchmarks/heldout_families.py --stage report --json benchmarks/recorded/heldout_families.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from server.training.dataset import parse_row, write_jsonl
from server.training.evaluate import engine_answers, paired_bootstrap
from server.training.families import FAMILIES, LM, TEAM, generate, mixture, score
from server.training.trainer import FinetuneConfig, finetune

TEAM_BASE = Path(__file__).resolve().parent.parent / "examples" / "modules" / "team-base"
TRAIN_SEED, HELD_OUT_SEED, JOINT_SEED = 0, 1, 2


def rows_of(a: argparse.Namespace, family: str) -> tuple[Path, Path]:
    d = Path(a.out) / "data"
    train, held = d / f"{family}-train.jsonl", d / f"{family}-heldout.jsonl"
    if not train.is_file():
        write_jsonl(generate(family, a.train, seed=TRAIN_SEED), train)
        write_jsonl(generate(family, a.held_out, seed=HELD_OUT_SEED), held)
    return train, held


def stage_family(a: argparse.Namespace, family: str) -> dict:
    d = Path(a.out) / a.tag / family
    result_file = d / "result.json"
    if result_file.is_file():
        return json.loads(result_file.read_text())
    train, held = rows_of(a, family)
    base = Path(a.base)
    seconds = {}
    for arm, standard in (("own", True), ("shared", False)):
        if not (d / arm / "training.json").is_file():
            t0 = time.perf_counter()
            finetune(FinetuneConfig(base=base, data=train, output=d / arm, name=f"{family}-{arm}", rank=8,
                                    alpha=16.0, epochs=1.0, batch_size=8, lr=1e-3, autocast=True,
                                    cache_conditioned=not standard, threads=a.threads, progress=not a.quiet))
            seconds[arm] = round(time.perf_counter() - t0, 1)
        else:
            seconds[arm] = json.loads((d / arm / "training.json").read_text())["seconds"]
    examples = [parse_row(json.loads(line), line=i + 1) for i, line in enumerate(held.read_text().splitlines())]
    t0 = time.perf_counter()
    preds = engine_answers(base, {"own": d / "own", "shared": d / "shared"}, examples, dtype="bfloat16",
                           max_new_tokens=24, threads=a.threads, progress=not a.quiet)
    correct = {arm: [score(family, p, ex.response) for p, ex in zip(preds[arm], examples, strict=True)]
               for arm in preds}
    ci = paired_bootstrap(correct["shared"], correct["own"])
    result = {"family": family, "base": str(base), "tag": a.tag, "train_rows": a.train, "held_out": len(examples),
              "accuracy": {arm: sum(c) / len(c) for arm, c in correct.items()},
              "shared_minus_own": ci, "train_seconds": seconds,
              "eval_seconds": round(time.perf_counter() - t0, 1),
              "samples": [{"reference": ex.response, **{arm: preds[arm][i] for arm in preds}}
                          for i, ex in enumerate(examples[:8])]}
    result_file.write_text(json.dumps(result, indent=2))
    return result


def stage_joint(a: argparse.Namespace) -> Path:
    from server.models.loader import default_model_dir
    from server.training.joint import JointConfig, train_joint

    held = set(a.hold_out.split(","))
    unknown = held - set(FAMILIES)
    if unknown:
        raise SystemExit(f"unknown families to hold out: {', '.join(sorted(unknown))}")
    seen = [f for f in FAMILIES if f not in held] + [LM]
    out = Path(a.out) / "joint"
    data = Path(a.out) / "joint-mixture.jsonl"
    if not data.is_file():
        write_jsonl(mixture(seen, a.joint_rows, seed=JOINT_SEED), data)
    if not (out / "agentshare-joint.json").is_file():
        result = train_joint(JointConfig(base=a.joint_from or default_model_dir(), data=data, output=out, rank=16,
                                         alpha=32.0, decode_rank=8, epochs=a.joint_epochs, autocast=True,
                                         threads=a.threads, progress=not a.quiet))
        print(f"joint base: {result.steps} steps, {result.seconds:.0f} s, families {', '.join(seen)}")
    return out


def perplexity_texts() -> dict[str, list[str]]:
    """Held-out text no joint stage trains on: the standard library's subpackages (the ``lm``
    family reads only its top-level modules) and this project's docs."""
    import os

    lib = Path(os.__file__).parent
    root = Path(__file__).resolve().parent.parent
    return {"stdlib-packages": [p.read_text(encoding="utf-8", errors="replace")
                                for p in sorted(lib.glob("[a-z]*/*.py"))[:60]],
            "project-docs": [p.read_text(encoding="utf-8") for p in sorted((root / "docs").glob("*.md"))]}


def stage_perplexity(a: argparse.Namespace) -> dict:
    """Perplexity of each base (``--bases NAME=PATH,...``) on the held-out texts: 256-token
    windows, the same windows for every base."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from server.models.patch import resolve_model_dir

    torch.set_num_threads(a.threads)
    out: dict[str, dict[str, float]] = {}
    for item in a.bases.split(","):
        name, path = item.split("=", 1)
        d = resolve_model_dir(path or None)
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        out[name] = {}
        for corpus, texts in perplexity_texts().items():
            ids = [i for t in texts for i in tok.encode(t + "\n\n", add_special_tokens=False)]
            windows = [ids[i:i + 256] for i in range(0, min(len(ids), a.ppl_tokens) - 256, 256)]
            nll, n = 0.0, 0
            with torch.no_grad():
                for w in windows:
                    x = torch.tensor([w])
                    loss = model(input_ids=x, labels=x).loss.item()
                    nll, n = nll + loss * (len(w) - 1), n + len(w) - 1
            out[name][corpus] = round(math.exp(nll / n), 3)
        print(name, out[name])
    path = Path(a.out) / "perplexity.json"
    path.write_text(json.dumps(out, indent=2))
    return out


def report(a: argparse.Namespace) -> dict:
    results = [json.loads(p.read_text()) for p in sorted(Path(a.out).glob("*/*/result.json"))]
    print("| base | family | own | shared (k = 0) | shared − own, 95 % CI | training own / shared |")
    print("|---|---|---:|---:|---|---|")
    for r in results:
        ci = r["shared_minus_own"]
        print(f"| {r['tag']} | {r['family']} | {100 * r['accuracy']['own']:.1f} % | "
              f"{100 * r['accuracy']['shared']:.1f} % | {100 * ci['diff']:+.1f} [{100 * ci['lo']:+.1f}, "
              f"{100 * ci['hi']:+.1f}] | {r['train_seconds']['own']:.0f} s / {r['train_seconds']['shared']:.0f} s |")
    joint = Path(a.out) / "joint" / "agentshare-joint.json"
    ppl = Path(a.out) / "perplexity.json"
    doc = {"host": _cpu(), "results": results,
           "joint": json.loads(joint.read_text()) if joint.is_file() else None,
           "perplexity": json.loads(ppl.read_text()) if ppl.is_file() else None}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=2))
    return doc


def _cpu() -> str:
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0]}, {len(names)} cores" if names else platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=("families", "joint", "perplexity", "report"), default="families")
    p.add_argument("--families", default="prose-records,kv-blocks,counting,extraction")
    p.add_argument("--base", default=str(TEAM_BASE), help="a model directory or base patch")
    p.add_argument("--tag", default="before", help="names the base in the results")
    p.add_argument("--train", type=int, default=400)
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--hold-out", default="prose-records,kv-blocks,counting,extraction",
                   help="families the joint stage leaves out")
    p.add_argument("--joint-from", default=None, help="the base the joint stage starts from (default model)")
    p.add_argument("--joint-rows", type=int, default=200, help="rows per family in the joint mixture")
    p.add_argument("--joint-epochs", type=float, default=1.0)
    p.add_argument("--bases", default=f"default=,team={TEAM_BASE}",
                   help="--stage perplexity: NAME=PATH,... (an empty PATH: the default model)")
    p.add_argument("--ppl-tokens", type=int, default=32768, help="tokens of each held-out text to score")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="heldout-families")
    p.add_argument("--json", default=None)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args()
    if a.stage == "joint":
        stage_joint(a)
    elif a.stage == "perplexity":
        stage_perplexity(a)
    elif a.stage == "report":
        report(a)
    else:
        for family in a.families.split(","):
            if family not in FAMILIES or family in TEAM:
                raise SystemExit(f"{family!r} is not a family the team base left out; choose from "
                                 f"{', '.join(f for f in FAMILIES if f not in TEAM)}")
            r = stage_family(a, family)
            print(json.dumps({k: r[k] for k in ("family", "accuracy", "shared_minus_own")}))


if __name__ == "__main__":
    main()
