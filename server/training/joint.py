"""A jointly trained prefill module: PrefillShare's first stage, ``agentshare finetune --joint``.

The family's prefill module is trained briefly, *jointly* with one decode adapter per task, on a
mixture of all the family's tasks, then frozen and merged into the base weights. The merged model
is a new base (a new family digest: nothing cached for the old base is shared with it), on which
each task's decode module is then fine-tuned cache-conditioned, as usual (``agentshare finetune
--base NEW_BASE``)::

    row of task t:  [ context ............. ] [ turn + response ]
                      base + prefill adapter    base + prefill adapter + decode adapter t
                      (with gradients: the prefill learns to encode for every task)

The decode adapters of this stage only shape the prefill adapter's training; they are dropped.
Rows name their task (the ``task`` field, as ``server.training.tasks`` writes it).

>>> rows = [{"context": "Ada Kim lives in Oslo.", "instruction": "Where does Ada Kim live?",
...          "response": "Oslo", "task": "retrieval"},
...         {"context": "x = 4; y = x.", "instruction": "What is y?", "response": "4", "task": "planning"}]
>>> _ = write_jsonl(rows, "mix.jsonl")
>>> result = train_joint(JointConfig(base=model_dir, data="mix.jsonl", output="joint-base", rank=4,
...                                  alpha=8, decode_rank=4, progress=False))
>>> result.tasks, result.steps, result.family != family_digest(model_dir, kv_dtype="bfloat16")
(('planning', 'retrieval'), 2, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from server.engine.device import resolve_device
from server.kv.family import family_digest
from server.models.patch import apply_patch, exact_scale, is_patch, resolve_model_dir, save_patch
from server.training.dataset import Batch, DataError, collate, encode, read_jsonl, write_jsonl  # noqa: F401  (write_jsonl: the example)
from server.training.split import _causal_lm
from server.training.trainer import (
    CHECKPOINT_DIR,
    DEFAULT_TARGETS,
    BadOption,
    _schedule,
    resume,
    save_checkpoint,
)

PREFILL = "prefill"
RECORD = "agentshare-joint.json"
PATCH_DIR = "patch"
"""The base patch inside the joint base's directory (``server/models/patch.py``): the few MB to
ship or commit instead of the base's weights."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JointConfig:
    base: Path | str
    data: Path | str  # a JSONL mixture; every row names its task
    output: Path | str  # the new base model directory
    rank: int = 16  # the prefill adapter
    alpha: float = 32.0
    decode_rank: int = 8  # each task's decode adapter during this stage
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    epochs: float = 1.0
    batch_size: int = 8
    lr: float = 1e-3
    warmup: float = 0.05
    max_length: int = 2048
    seed: int = 0
    kv_dtype: str = "bfloat16"  # of the new family
    autocast: bool = False
    threads: int | None = None
    device: str = "auto"  # auto, cpu, cuda, cuda:N (server/engine/device.py)
    checkpoint_every: int = 25  # steps; rerunning the same run resumes from output/checkpoint/ (0: never)
    progress: bool = True

    def resume_key(self) -> dict[str, Any]:
        """What names the run for a resume: everything but where and how it runs."""
        rec = json.loads(json.dumps(dataclasses.asdict(self), default=str))
        for k in ("output", "threads", "device", "progress", "checkpoint_every"):
            rec.pop(k)
        return rec


@dataclass(slots=True)
class JointResult:
    output: Path
    family: str  # the new base's family digest
    tasks: tuple[str, ...]
    steps: int
    examples: int
    seconds: float
    losses: list[float] = field(default_factory=list)


def train_joint(cfg: JointConfig) -> JointResult:
    """Train the prefill adapter jointly with per-task decode adapters, merge it into the base,
    and write the new base (weights, config, tokenizer, and ``agentshare-joint.json``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    out = Path(cfg.output)
    given, patched = cfg.base, is_patch(cfg.base)  # a joint base trained on another: its patch is named as its base
    cfg = dataclasses.replace(cfg, base=resolve_model_dir(cfg.base))
    if Path(cfg.base).resolve() == out.resolve():
        raise BadOption("--output must be a new directory: the joint base replaces nothing in place")
    if not exact_scale(cfg.alpha / cfg.rank):
        raise BadOption(f"--alpha / --rank must be a power of two (the base patch merges exactly), got "
                        f"{cfg.alpha} / {cfg.rank}: e.g. --alpha {2 * cfg.rank}")
    examples = read_jsonl(cfg.data)
    missing = next((ex for ex in examples if not ex.task), None)
    if missing is not None:
        raise DataError(f"{missing.where}: a joint run needs every row's 'task' (its decode adapter)")
    tasks = tuple(sorted({str(ex.task) for ex in examples}))
    tokenizer = AutoTokenizer.from_pretrained(cfg.base)
    items = encode(examples, tokenizer, max_length=cfg.max_length)
    by_task = {t: [i for i, ex in enumerate(examples) if ex.task == t] for t in tasks}

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    model: Any = AutoModelForCausalLM.from_pretrained(cfg.base, dtype=torch.float32)
    model = model.to(device)
    lora = dict(lora_dropout=0.0, target_modules=list(cfg.target_modules))
    model = get_peft_model(model, LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, **lora),  # type: ignore[arg-type]
                           adapter_name=PREFILL)
    for t in tasks:
        model.add_adapter(t, LoraConfig(r=cfg.decode_rank, lora_alpha=2 * cfg.decode_rank, **lora))  # type: ignore[arg-type]
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    model.train()
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    order = _order(by_task, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(len(order), cfg.warmup))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.autocast else contextlib.nullcontext()
    key = dataclasses.replace(cfg, base=str(given)).resume_key()
    step, losses = resume(out / CHECKPOINT_DIR, key, model, opt, sched)
    resumed = step
    bar = tqdm(total=len(order), initial=step, desc="finetune --joint", disable=not cfg.progress)
    for task, batch_idx in order[step:]:
        batch = collate([items[i] for i in batch_idx], pad).to(device)
        with amp:
            loss = _loss(model, task, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < len(order):
            save_checkpoint(out / CHECKPOINT_DIR, key, model, opt, sched, step, losses,
                            names={n for n, _ in model.named_parameters() if "lora_" in n})  # every task's adapter
    bar.close()

    # The decode adapters are dropped; the prefill adapter, rounded to bf16, is the base patch,
    # and the new base is built from it exactly as a patch is applied anywhere else
    seconds = time.perf_counter() - t0
    record = {"config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)), "tasks": list(tasks),
              "steps": len(order), "examples": len(items), "seconds": round(seconds, 1), "resumed_at_step": resumed,
              "final_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4),
              "from_family": family_digest(cfg.base, kv_dtype=cfg.kv_dtype)}
    scale = cfg.alpha / cfg.rank
    patch = save_patch(prefill_adapter(model), out / PATCH_DIR, base=cfg.base, scale=scale, record=record,
                       base_name=str(Path(given).resolve()) if patched else None)
    apply_patch(patch, out, base=cfg.base)
    family = family_digest(out, kv_dtype=cfg.kv_dtype)
    (out / RECORD).write_text(json.dumps({**record, "family": family, "patch": PATCH_DIR}, indent=2) + "\n")
    shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
    return JointResult(out, family, tasks, len(order), len(items), seconds, losses)


def prefill_adapter(model: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The prefill adapter of a peft model: each adapted projection's name in the base model
    (``model.layers.0.self_attn.q_proj``) -> ``(lora_A, lora_B)`` weights."""
    from peft.tuners.lora import LoraLayer

    layers = [(name, mod) for name, mod in model.base_model.model.named_modules()
              if isinstance(mod, LoraLayer) and PREFILL in mod.lora_A]
    return {name: (cast(torch.Tensor, mod.lora_A[PREFILL].weight), cast(torch.Tensor, mod.lora_B[PREFILL].weight))
            for name, mod in layers}


def _loss(model: Any, task: str, batch: Batch) -> torch.Tensor:
    """Prefix with the prefill adapter (with gradients), suffix with it and the task's adapter;
    cross-entropy on the response tokens."""
    lm = _causal_lm(model)
    P = batch.prefix_len
    cache = DynamicCache()
    model.base_model.set_adapter(PREFILL)
    if P:
        lm.model(input_ids=batch.input_ids[:, :P], attention_mask=batch.attention_mask[:, :P],
                 position_ids=batch.position_ids[:, :P], past_key_values=cache, use_cache=True)
    model.base_model.set_adapter([PREFILL, task])
    h = lm.model(input_ids=batch.input_ids[:, P:], attention_mask=batch.attention_mask,
                 position_ids=batch.position_ids[:, P:], past_key_values=cache, use_cache=True).last_hidden_state
    sel = batch.labels != -100
    return torch.nn.functional.cross_entropy(lm.lm_head(h[sel]).float(), batch.labels[sel])


def _order(by_task: dict[str, list[int]], cfg: JointConfig) -> list[tuple[str, list[int]]]:
    """Single-task batches of every task, interleaved at random (deterministic from the seed):
    one epoch is every row once."""
    rng = random.Random(cfg.seed)
    batches: list[tuple[str, list[int]]] = []
    for task, idx in by_task.items():
        rows: list[int] = []
        for _ in range(math.ceil(cfg.epochs)):
            perm = list(idx)
            rng.shuffle(perm)
            rows += perm
        rows = rows[: max(1, round(cfg.epochs * len(idx)))]
        batches += [(task, rows[i:i + cfg.batch_size]) for i in range(0, len(rows), cfg.batch_size)]
    rng.shuffle(batches)
    return batches

