"""Evaluate decode modules: greedy answers, scores, paired intervals.

Two paths over the same held-out examples:

- :func:`answers`, the transformers reference path. Several *arms* (a module + whether it decodes
  from the base's shared prefill or its own) run; arms that share compute the base prefix KV
  once per batch and each continues from a copy of it.
- :func:`engine_answers`, the serving engine itself: every module loaded into one engine, every
  example submitted as a request. A module with a manifest of the engine's family decodes from
  the base's shared prefill; one without (a standard fine-tune) gets a private prefill. This is
  what a user of the server gets.

>>> paired_bootstrap([True, True, False, True], [True, False, False, True], seed=0)["diff"]
0.25
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from server.prompt import Placement
from server.training.dataset import Example, collate, encode
from server.training.split import SplitModel
from server.training.tasks import score


@dataclass(frozen=True, slots=True)
class Arm:
    """A module to evaluate; ``shared``: decode from the base's prefill (split at the IP)."""

    model: SplitModel
    shared: bool
    placement: Placement = Placement.TURN


def load_split(base: Path | str, module: Path | str | None = None, *, autocast: bool = False,
               recompute: int = 0) -> SplitModel:
    """A base (``module=None``) or a saved module directory (lora or full) ready to evaluate."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if module is None:
        return SplitModel(model, autocast=autocast, recompute=recompute)
    module = Path(module)
    if (module / "adapter_config.json").is_file():
        from peft import PeftModel

        return SplitModel(PeftModel.from_pretrained(model, module).eval(), autocast=autocast,
                          recompute=recompute)
    full = AutoModelForCausalLM.from_pretrained(module, dtype=torch.float32).eval()
    return SplitModel(full, model, autocast=autocast, recompute=recompute)


def answers(arms: Mapping[str, Arm], examples: Sequence[Example], tokenizer: Any, *,
            batch_size: int = 16, max_new_tokens: int = 32, progress: bool = False) -> dict[str, list[str]]:
    """Greedy answers of every arm to every example (prompts laid out canonically)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    out: dict[str, list[str]] = {name: [] for name in arms}
    enc = {p: encode(examples, tokenizer, placement=p, with_response=False, max_length=1 << 30)
           for p in {a.placement for a in arms.values()}}
    order = sorted(range(len(examples)), key=lambda i: len(enc[Placement.TURN if Placement.TURN in enc
                                                               else next(iter(enc))][i].ids))
    results: dict[str, dict[int, str]] = {name: {} for name in arms}
    for start in tqdm(range(0, len(order), batch_size), desc="evaluate", disable=not progress):
        idx = order[start:start + batch_size]
        shared_prefix: dict[Placement, Any] = {}
        for name, arm in arms.items():
            batch = collate([enc[arm.placement][i] for i in idx], pad, split=arm.shared)
            cache = None
            if arm.shared and arm.model.recompute == 0:  # the base's KV alone: compute it once
                if arm.placement not in shared_prefix:
                    shared_prefix[arm.placement] = arm.model.prefix(batch)
                cache = copy.deepcopy(shared_prefix[arm.placement])
            seqs = arm.model.generate(batch, max_new_tokens=max_new_tokens, eos_id=eos, cache=cache)
            for i, seq in zip(idx, seqs, strict=True):
                results[name][i] = tokenizer.decode(seq, skip_special_tokens=True)
    for name in arms:
        out[name] = [results[name][i] for i in range(len(examples))]
    return out


def engine_answers(
    base: Path | str, modules: Mapping[str, Path | str], examples: Sequence[Example], *,
    dtype: str = "bfloat16", max_new_tokens: int = 32, threads: int | None = None,
    kv_cache_bytes: int = 2 << 30, include_base: bool = True, progress: bool = False,
) -> dict[str, list[str]]:
    """Greedy answers through the engine, by module name (``"base"`` too with ``include_base``).

    The engine's dtype is part of the family (docs/design.md §2): a module trained for a bf16 KV shares
    the prefill only in a bf16 engine; in another it is served privately, as a foreign module.
    """
    from server.engine.build import load_engine
    from server.engine.core import EngineConfig
    from server.engine.sampling import SamplingParams
    from server.training.dataset import prompt_of

    names = (["base"] if include_base else []) + list(modules)
    config = EngineConfig(kv_cache_bytes=kv_cache_bytes, max_waiting=len(examples) * len(names) + 1)
    core = load_engine(base, modules=dict(modules), dtype=dtype, threads=threads, config=config)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    texts: dict[str, list[str]] = {}
    for i, ex in enumerate(examples):
        prompt = prompt_of(core.tokenizer, ex)
        for name in names:
            core.add_request(f"{name}\x00{i}", name, prompt, params)
            texts[f"{name}\x00{i}"] = []
    bar = tqdm(total=len(texts), desc="evaluate (engine)", disable=not progress)
    while core.has_work:
        for ev in core.step():
            texts[ev.request_id].append(ev.text)
            if ev.error:
                raise RuntimeError(f"request {ev.request_id!r} failed in the engine: {ev.error}")
            bar.update(ev.finish_reason is not None)
    bar.close()
    return {name: ["".join(texts[f"{name}\x00{i}"]) for i in range(len(examples))] for name in names}


def accuracy(task: str, predictions: Sequence[str], examples: Sequence[Example]) -> list[bool]:
    """Per-example correctness (:func:`server.training.tasks.score`)."""
    return [score(task, p, ex.response) for p, ex in zip(predictions, examples, strict=True)]


def paired_bootstrap(a: Sequence[bool] | Sequence[float], b: Sequence[bool] | Sequence[float], *,
                     reps: int = 2000, seed: int = 0, level: float = 0.95) -> dict[str, float]:
    """Mean of ``a - b`` over paired examples (right/wrong, or scores in [0, 1]), with a
    percentile bootstrap interval."""
    if len(a) != len(b) or not a:
        raise ValueError("paired samples must be non-empty and of equal length")
    d = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    n = len(d)
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(reps))
    lo = means[int((1 - level) / 2 * reps)]
    hi = means[min(reps - 1, int((1 + level) / 2 * reps))]
    return {"diff": sum(d) / n, "lo": lo, "hi": hi, "n": n}
