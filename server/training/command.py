"""``agentshare finetune``: turn command-line options into a :class:`FinetuneConfig` and run it.

Errors a user can fix (bad data, wrong family, missing model: :func:`finetune_errors`) are
printed by the CLI as one line on stderr with exit status 2, not as a traceback.

>>> import pathlib, tempfile
>>> base = pathlib.Path(tempfile.mkdtemp())  # a model directory: its config.json, at least
>>> _ = (base / "config.json").write_text("{}")
>>> cfg = config_from_options({"data": "d.jsonl", "output": "o", "name": "x", "base": str(base),
...                            "kind": "full", "target": None, "placement": "header"})
>>> cfg.kind.value, cfg.placement.value, cfg.target_modules[:2]
('full', 'header', ('q_proj', 'k_proj'))
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from server.modules.manifest import ManifestError, ModuleKind
from server.prompt import Placement
from server.training.dataset import DataError
from server.training.trainer import (
    DEFAULT_TARGETS,
    BadOption,
    FamilyMismatch,
    FinetuneConfig,
    finetune,
)

_DIRECT = ("rank", "alpha", "epochs", "batch_size", "lr", "max_length", "seed", "kv_dtype",
           "family", "checkpoint_every", "threads", "layers", "recompute", "device")


def config_from_options(opts: Mapping[str, Any]) -> FinetuneConfig:
    """Map the CLI's option names onto a :class:`FinetuneConfig` (absent options: defaults)."""
    _check_device(opts)
    from server.models.patch import resolve_model_dir

    base = resolve_model_dir(opts.get("base"))
    try:
        kind = ModuleKind(opts.get("kind", "lora"))
        placement = Placement(opts.get("placement", "turn"))
    except ValueError as exc:
        raise DataError(f"bad option: {exc}") from None
    extra = {k: opts[k] for k in _DIRECT if opts.get(k) is not None}
    return FinetuneConfig(
        base=Path(base), data=Path(opts["data"]), output=Path(opts["output"]), name=opts["name"],
        kind=kind, placement=placement, target_modules=tuple(opts.get("target") or DEFAULT_TARGETS),
        cache_conditioned=not opts.get("standard", False), autocast=bool(opts.get("bf16", False)),
        **extra)


def _check_device(opts: Mapping[str, Any]) -> None:
    """A ``--device`` this process cannot use is refused before anything loads."""
    if opts.get("device") is not None:
        from server.engine.device import resolve_device

        try:
            resolve_device(opts["device"])
        except ValueError as exc:
            raise BadOption(str(exc)) from None


def finetune_errors() -> dict[type[Exception], str | None]:
    """What ``agentshare finetune`` reports as one line with exit status 2 (the CLI's
    ``_refusing_bad_input``): input the user can fix. The messages say what to do."""
    from server.models.loader import ModelLoadError

    return dict.fromkeys((DataError, BadOption, FamilyMismatch, ManifestError, FileNotFoundError, ModelLoadError))


def finetune_joint_errors() -> dict[type[Exception], str | None]:
    """The same for ``agentshare finetune-joint``."""
    from server.models.loader import ModelLoadError

    return dict.fromkeys((DataError, BadOption, FileNotFoundError, ModelLoadError, OSError))


def run_finetune(opts: Mapping[str, Any]) -> None:
    """Run the command (the errors of :func:`finetune_errors` are the user's to fix)."""
    if opts.get("fidelity") is not None:
        from server.training.fidelity import FidelityOptions, finetune_with_fidelity

        held = opts.get("fidelity_held_out", 0.2)
        fid = FidelityOptions(points=opts["fidelity"], held_out=int(held) if held >= 1 else float(held),
                              step=opts.get("fidelity_step", 1), seed=opts.get("seed") or 0)
        searched = finetune_with_fidelity(config_from_options(opts), fid)
        print(searched.table())
        print(f"wrote {searched.output} (recompute_layers {searched.k}; the figures are in its manifest)")
        return
    result = finetune(config_from_options(opts))
    print(f"wrote {result.output} ({result.steps} steps, {result.examples} examples, "
          f"{result.seconds:.0f} s, family {result.family[:12]}…)")


def run_finetune_joint(opts: Mapping[str, Any]) -> None:
    """``agentshare finetune-joint`` (the errors of :func:`finetune_joint_errors` are the user's
    to fix)."""
    from server.models.loader import default_model_dir
    from server.training.joint import JointConfig, train_joint

    _check_device(opts)
    cfg = JointConfig(base=opts.get("base") or default_model_dir(), data=opts["data"], output=opts["output"],
                      rank=opts["rank"], alpha=opts["alpha"], decode_rank=opts["decode_rank"],
                      epochs=opts["epochs"], batch_size=opts["batch_size"], lr=opts["lr"], seed=opts["seed"],
                      kv_dtype=opts["kv_dtype"], autocast=bool(opts["bf16"]), threads=opts["threads"],
                      device=opts.get("device") or "auto")
    result = train_joint(cfg)
    print(f"wrote the joint base {result.output} ({', '.join(result.tasks)}; {result.steps} steps, "
          f"{result.seconds:.0f} s): family {result.family[:12]}…, a new family; fine-tune each decode module "
          f"on it with `agentshare finetune --base {result.output}`")
