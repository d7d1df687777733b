"""The layer split's prefill cost in the engine: a module that recomputes its top k of L layers
over a shared context, against the same module's private prefill, on the default model.

For each k, one random LoRA module (rank 8, all seven projections) with ``recompute_layers: k``
is served beside the base. Per repetition, a fresh context of ``--context`` tokens is pinned by
the base (as ``client.context`` does), then the module answers one short turn, one token:

- ``fill``: its prefix is filled from the pinned blocks: the base's lower layers read, its top
  k layers recomputed from the hidden state the base kept;
- ``private``: the same weights without a manifest, which prefill the whole context themselves.

The prediction for ``fill / private`` is k / L (the turn's own tokens aside). Medians over
``--reps``, both arms in one run on the same cores.

    python benchmarks/layer_split.py [--ks 0,8,15,22,30] [--context 2048] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from server.engine.build import load_engine
from server.engine.core import EngineConfig, EngineCore
from server.engine.numerics import set_threads
from server.engine.sampling import SamplingParams
from server.kv.family import family_digest
from server.models.loader import default_model_dir
from server.modules.manifest import MANIFEST_FILE, LoraSpec, Manifest, ModuleKind
from server.prompt import Prompt

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_module(model_dir: Path, family: str, k: int, out: Path) -> Path:
    """A random LoRA (rank 8, non-zero) recomputing its top ``k`` layers."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7 + k)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    model.save_pretrained(out)
    Manifest(name=out.name, kind=ModuleKind.LORA, family=family, lora=LoraSpec(8, 16.0, TARGETS),
             recompute_layers=k).write(out)
    return out


def one(core: EngineCore, module: str, prompt: Prompt) -> float:
    """Seconds from submission to the module's first (only) token."""
    start = time.perf_counter()
    core.add_request("r", module, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while core.has_work:
        core.step()
    return time.perf_counter() - start


def run(core: EngineCore, ks: list[int], *, context: int, reps: int, vocab: int, quiet: bool = False) -> list[dict]:
    rows = []
    for k in ks:
        fill, private, filled = [], [], []
        for rep in range(reps):
            g = torch.Generator().manual_seed(1000 * k + rep)  # a fresh context: nothing cached across reps
            ctx = torch.randint(100, vocab, (context,), generator=g).tolist()
            turn = torch.randint(100, vocab, (24,), generator=g).tolist()
            prompt = Prompt(tuple(ctx + turn), context, context, context + len(turn))
            core.add_context("ctx", ctx, ttl=600)
            while core.has_work:
                core.step()
            before = core.stats.recomputed_prefix_tokens
            fill.append(one(core, f"k{k}", prompt))
            filled.append(core.stats.recomputed_prefix_tokens - before)
            private.append(one(core, f"k{k}-private", prompt))
            core.release_context("ctx")
        L = core.forward.weights.shape.num_layers
        f, p = statistics.median(fill), statistics.median(private)
        rows.append({"k": k, "layers": L, "fill_s": f, "private_s": p, "ratio": f / p, "predicted": k / L,
                     "filled_tokens": filled[0], "fill_runs": fill, "private_runs": private})
        if not quiet:
            print(f"k={k:>2}/{L}: fill {f:.3f} s, private {p:.3f} s, ratio {f / p:.2f} (predicted {k / L:.2f}), "
                  f"{filled[0]} context tokens filled", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ks", default="0,8,15,22,30")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--model", type=Path, default=None, help="a model directory (default: the default model)")
    a = p.parse_args()
    threads = set_threads(a.threads)
    model_dir = a.model or default_model_dir()
    family = family_digest(model_dir, kv_dtype=a.dtype)
    ks = [int(x) for x in a.ks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        modules = {}
        for k in ks:
            d = make_module(model_dir, family, k, Path(tmp) / f"k{k}")
            private = shutil.copytree(d, Path(tmp) / f"k{k}-private", ignore=shutil.ignore_patterns(MANIFEST_FILE))
            modules |= {f"k{k}": d, f"k{k}-private": private}
        core = load_engine(model_dir, modules=modules, dtype=a.dtype,
                           config=EngineConfig(kv_cache_bytes=1 << 30, max_prefill_step_tokens=2048))
        print(f"{'default model' if a.model is None else model_dir.name}, {a.dtype}, {threads} threads, context {a.context} tokens, medians of {a.reps}")
        run(core, ks[:1], context=256, reps=1, vocab=core.forward.weights.shape.vocab_size, quiet=True)  # warm-up
        rows = run(core, ks, context=a.context, reps=a.reps, vocab=core.forward.weights.shape.vocab_size)
    if a.json:
        out = {"benchmark": "layer_split", "dtype": a.dtype, "threads": threads, "context": a.context,
               "reps": a.reps, "machine": platform.processor() or platform.machine(),
               "date": time.strftime("%Y-%m-%d"), "rows": rows}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
