"""Cache-conditioned fine-tuning of a decode module: the engine of ``agentshare finetune``.

For every example the frozen base computes the KV of ``tokens[:IP]`` without gradients (the KV
a server shares); the module (base + LoRA, or a full copy) continues from that cache over
``tokens[IP:]``, with loss on the response only (:class:`server.training.split.SplitModel`).
The result is a module directory the engine loads without peft::

    out/  adapter_config.json  adapter_model.safetensors   (kind lora, peft format)
          config.json  model.safetensors                   (kind full)
          agentshare-module.json                           (manifest: family, IP placement)
          checkpoint/                                      (resumable state; removed at the end)

``cache_conditioned=False`` trains a *standard* module (its own prefill; the fidelity baseline):
it gets no manifest, so a server gives it a private prefill instead of sharing the base's.
``recompute=k`` trains a LoRA module that recomputes the prefix KV of its top k layers from the
base's hidden state at that depth (the layer split): its manifest says ``recompute_layers: k``,
and the engine serves it so (the base's KV below the split, the module's own above it).
``layers=n`` tunes only the top n layers (LoRA on them, or only their weights for a full module):
the lower layers stay the base's for every position — with ``recompute=n``, the split of the model
at a layer boundary (lower layers frozen and shared, upper layers task-specific).

>>> cfg = FinetuneConfig(base="m", data="d.jsonl", output="out", name="coder")
>>> cfg.kind.value, cfg.rank, cfg.placement.value, cfg.cache_conditioned
('lora', 16, 'turn', True)
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from server.engine.device import resolve_device
from server.kv.family import family_digest
from server.models.patch import patch_of, resolve_model_dir
from server.modules.manifest import LoraSpec, Manifest, ModuleKind
from server.prompt import Placement
from server.training.dataset import DataError, check_family, collate, encode, read_jsonl
from server.training.split import SplitModel

CHECKPOINT_DIR = "checkpoint"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class FamilyMismatch(ValueError):
    """The base model is not of the family the user (or an existing manifest) asked for."""


class BadOption(ValueError):
    """An option the base model cannot satisfy (e.g. more layers to tune than it has)."""


@dataclass(frozen=True, slots=True)
class FinetuneConfig:
    """Everything one fine-tuning run needs; its JSON form is recorded in the manifest."""

    base: Path | str
    data: Path | str
    output: Path | str
    name: str
    kind: ModuleKind = ModuleKind.LORA
    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    placement: Placement = Placement.TURN
    cache_conditioned: bool = True
    epochs: float = 1.0
    batch_size: int = 8
    lr: float | None = None  # default: 1e-3 for lora, 5e-5 for full
    warmup: float = 0.05  # share of steps with a linear warm-up
    weight_decay: float = 0.0
    max_length: int = 2048
    seed: int = 0
    kv_dtype: str = "bfloat16"  # the dtype the server will keep the family's KV in
    family: str | None = None  # refuse a base whose family differs
    autocast: bool = False  # bf16 matmuls (faster; fp32 master weights)
    device: str = "auto"  # where it trains: auto, cpu, cuda, cuda:N (server/engine/device.py)
    recompute: int = 0  # the module recomputes the prefix KV of its top k layers (the layer split)
    layers: int = 0  # tune only the top n layers (0: all)
    checkpoint_every: int = 50  # steps; 0 = never
    threads: int | None = None
    progress: bool = True

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (1e-3 if self.kind is ModuleKind.LORA else 5e-5)

    def to_record(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.loads(json.dumps(d, default=str))


@dataclass(slots=True)
class FinetuneResult:
    output: Path
    family: str
    steps: int
    examples: int
    seconds: float
    losses: list[float] = field(default_factory=list)


def finetune(cfg: FinetuneConfig) -> FinetuneResult:
    """Train a decode module as ``cfg`` says and write it (with manifest) to ``cfg.output``.

    >>> row = {"context": "Ada Kim lives in Oslo.", "instruction": "Where does Ada Kim live?", "response": "Oslo"}
    >>> _ = Path("train.jsonl").write_text(json.dumps(row) + "\\n")
    >>> result = finetune(FinetuneConfig(base=model_dir, data="train.jsonl", output="coder", name="coder",
    ...                                  rank=4, alpha=8, progress=False))
    >>> result.steps, sorted(p.name for p in result.output.glob("*.json"))   # with its manifest
    (1, ['adapter_config.json', 'agentshare-module.json', 'training.json'])
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    cfg = dataclasses.replace(cfg, base=resolve_model_dir(cfg.base))  # a base patch: the base it builds
    out = Path(cfg.output)
    family = check_base(cfg.base, out, kv_dtype=cfg.kv_dtype, family=cfg.family)
    examples = read_jsonl(cfg.data)
    check_family(examples, family)
    tokenizer = AutoTokenizer.from_pretrained(cfg.base)
    items = encode(examples, tokenizer, placement=cfg.placement, max_length=cfg.max_length)

    _seed(cfg.seed)
    device = resolve_device(cfg.device)
    model: Any = AutoModelForCausalLM.from_pretrained(cfg.base, dtype=torch.float32)  # or its peft wrapper
    model = model.to(device)
    tuned = _tuned_layers(cfg, model.config.num_hidden_layers)
    base = None
    if cfg.kind is ModuleKind.LORA:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0,  # type: ignore[arg-type]  # peft: int, a float scales too
                                                 target_modules=list(cfg.target_modules),
                                                 layers_to_transform=tuned, layers_pattern="layers" if tuned else None))
    elif cfg.kind is ModuleKind.FULL:
        if cfg.cache_conditioned:
            base = AutoModelForCausalLM.from_pretrained(cfg.base, dtype=torch.float32)
            base = base.to(device)  # type: ignore[arg-type]  # transformers' to() takes a device
        if tuned:  # only the top layers learn: everything below them (and the embeddings) stays the base's
            model.requires_grad_(False)
            for i in tuned:
                model.model.layers[i].requires_grad_(True)
            model.model.norm.requires_grad_(True)
    else:
        raise ValueError(f"cannot fine-tune a module of kind {cfg.kind.value!r}; use lora or full")
    model.train()
    split = SplitModel(model, base, autocast=cfg.autocast, recompute=cfg.recompute)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    order = _order(len(items), cfg)
    total = len(order)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(total, cfg.warmup))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    step, losses = resume(out / CHECKPOINT_DIR, _resume_key(cfg), model, opt, sched)
    bar = tqdm(total=total, initial=step, desc=f"finetune {cfg.name}", disable=not cfg.progress)
    while step < total:
        batch = collate([items[i] for i in order[step]], pad, split=cfg.cache_conditioned).to(device)
        loss = split.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        losses.append(loss.item())
        bar.update()
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < total:
            save_checkpoint(out / CHECKPOINT_DIR, _resume_key(cfg), model, opt, sched, step, losses)
    bar.close()
    seconds = time.perf_counter() - t0
    result = FinetuneResult(out, family, step, len(items), seconds, losses)
    _save_module(cfg, model, tokenizer, result)
    shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
    return result


def check_base(base: Path | str, output: Path | str, *, kv_dtype: str, family: str | None) -> str:
    """The base's family digest; raises :class:`FamilyMismatch` if it is not the one expected."""
    if not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"{base} is not a model directory (no config.json)")
    actual = family_digest(base, kv_dtype=kv_dtype)
    if family is not None and family != actual:
        raise FamilyMismatch(f"the base model {base} (KV dtype {kv_dtype}) is of family "
                             f"{actual[:12]}…, not the requested {family[:12]}…; refusing to train")
    existing = Manifest.read(output) if Path(output).is_dir() else None
    if existing is not None and existing.family != actual:
        raise FamilyMismatch(f"{output} already holds a module of family {existing.family[:12]}…; "
                             f"the base {base} is of family {actual[:12]}…; refusing to overwrite")
    return actual


def _tuned_layers(cfg: FinetuneConfig, num_layers: int) -> list[int] | None:
    """Indices of the layers the module tunes (None: all of them)."""
    if not 0 <= cfg.recompute <= num_layers:
        raise BadOption(f"recompute={cfg.recompute}: the base has {num_layers} layers; recompute 0..{num_layers}")
    if cfg.recompute and cfg.kind is not ModuleKind.LORA and cfg.cache_conditioned:
        raise BadOption("recompute: the engine serves the layer split for lora modules; train --kind lora")
    if cfg.layers == 0:
        return None
    if not 0 < cfg.layers <= num_layers:
        raise BadOption(f"layers={cfg.layers}: the base has {num_layers} layers; tune 1..{num_layers} (0: all)")
    return list(range(num_layers - cfg.layers, num_layers))


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _order(n: int, cfg: FinetuneConfig) -> list[list[int]]:
    """Batches of example indices for the whole run (deterministic from the seed)."""
    rng = random.Random(cfg.seed)
    idx: list[int] = []
    for _ in range(math.ceil(cfg.epochs)):
        perm = list(range(n))
        rng.shuffle(perm)
        idx += perm
    idx = idx[: max(1, round(cfg.epochs * n))]
    return [idx[i:i + cfg.batch_size] for i in range(0, len(idx), cfg.batch_size)]


def _schedule(total: int, warmup: float) -> Any:
    w = max(1, int(warmup * total))

    def f(step: int) -> float:
        if step < w:
            return (step + 1) / w
        return max(0.0, 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, total - w))))

    return f


def _trainable(model: torch.nn.Module, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The weights a checkpoint keeps: ``names``, or those that require gradients now."""
    return {k: p.detach().cpu().contiguous() for k, p in model.named_parameters()
            if (k in names if names is not None else p.requires_grad)}


def save_checkpoint(d: Path, key: dict[str, Any], model: Any, opt: Any, sched: Any,
                    step: int, losses: list[float], names: set[str] | None = None) -> None:
    """The trainable weights (``names``, or those requiring gradients now), optimiser, schedule
    and RNG after ``step`` steps, written whole (a temporary directory renamed into place);
    ``key`` names the run (:func:`resume` checks it)."""
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(_trainable(model, names), tmp / "trainable.safetensors")
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(),
                "rng": torch.get_rng_state()}, tmp / "state.pt")
    (tmp / "progress.json").write_text(json.dumps({"step": step, "losses": losses, "config": key}))
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)


def _resume_key(cfg: FinetuneConfig) -> dict[str, Any]:
    rec = cfg.to_record()
    for k in ("output", "progress", "checkpoint_every", "threads", "device"):  # a run may resume elsewhere
        rec.pop(k)
    return rec


def resume(d: Path, key: dict[str, Any], model: Any, opt: Any, sched: Any) -> tuple[int, list[float]]:
    """Load the checkpoint in ``d`` (if any) into the model, optimiser and schedule: (steps done,
    losses so far); a checkpoint of another run (``key`` differs) is refused."""
    if not (d / "progress.json").is_file():
        return 0, []
    prog = json.loads((d / "progress.json").read_text())
    if prog["config"] != key:
        raise DataError(f"{d} holds a checkpoint of a different run (other data or settings); "
                        "remove it or train into another output directory")
    state = load_file(d / "trainable.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in state.items():
            params[k].copy_(v)
    s = torch.load(d / "state.pt", weights_only=False)
    opt.load_state_dict(s["opt"])
    sched.load_state_dict(s["sched"])
    torch.set_rng_state(s["rng"])
    return int(prog["step"]), list(prog["losses"])


def _save_module(cfg: FinetuneConfig, model: Any, tokenizer: Any, result: FinetuneResult) -> None:
    out = result.output
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if cfg.kind is ModuleKind.FULL:
        tokenizer.save_pretrained(out)
    patch = patch_of(cfg.base)  # a patched base is named by its patch, not by its build in the cache
    training = {"config": cfg.to_record(), "base": str(patch or cfg.base), "steps": result.steps,
                "examples": result.examples,
                "seconds": round(result.seconds, 1),
                "final_loss": round(sum(result.losses[-20:]) / max(1, len(result.losses[-20:])), 4)}
    (out / "training.json").write_text(json.dumps(training, indent=2))
    if not cfg.cache_conditioned:
        return  # a standard module was not trained on the base's KV: it must not share it
    lora = LoraSpec(cfg.rank, cfg.alpha, tuple(cfg.target_modules)) if cfg.kind is ModuleKind.LORA else None
    Manifest(name=cfg.name, kind=cfg.kind, family=result.family, invocation=cfg.placement,
             lora=lora, training=training, recompute_layers=cfg.recompute).write(out)
