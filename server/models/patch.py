"""Base patches: a base model written as a low-rank change to another, small enough to commit.

A jointly trained base (``agentshare finetune-joint``) is the original base plus a merged LoRA:
a full copy of the weights (540 MB at 135M), where the change itself is a few MB. A *base
patch* directory keeps only the change, rounded to bf16, with what it applies to::

    joint-base.patch/
        agentshare-patch.json     the original base ("default" or a path), its family digest,
                                  the family of the result, LoRA scale, rank, targets
        adapter.safetensors       per projection: lora_A [r, in], lora_B [out, r] in bf16

Applying it is deterministic, bit for bit, on any machine: every weight ``W`` of an adapted
projection becomes ``fp32(W + Σ_j scale · B[:, j] ⊗ A[j, :])``, each outer product exact in
float64 (a product of two bf16 numbers and a power of two fits its mantissa) and the sum taken
in a fixed order, elementwise; no matrix multiply, whose summation order varies with the BLAS.
So the patched base has the family digest the patch records, and the modules trained on it
share its prefill wherever it is rebuilt. ``finetune-joint`` writes its base with this very
merge, so its output and a base rebuilt from its patch are one family.

Where a model directory is expected (``--model``, ``--base``), a patch directory may be given:
:func:`resolve_model_dir` builds the patched base once under the cache directory (atomically,
like the default model's conversion) and returns it.

>>> from server.models.loader import load_model
>>> up = load_model(model_dir).model.model.layers[0].mlp.up_proj.weight      # [out, in]
>>> a, b = torch.randn(2, up.shape[1]), torch.randn(up.shape[0], 2)          # a rank-2 change
>>> p = save_patch({"model.layers.0.mlp.up_proj": (a, b)}, "p", base=model_dir, scale=2.0)
>>> built = apply_patch(p, "patched")                  # resolve_model_dir(p): built once, in the cache
>>> from server.kv.family import family_digest
>>> family_digest(built, kv_dtype="float32") == read_patch(p)["family"], is_patch(p), is_patch(built)
(True, True, False)
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from server.models.loader import (
    CONVERSION_MARKER,
    DEFAULT_GGUF,
    ModelLoadError,
    build_atomically,
    default_model_dir,
)
from server.paths import cache_dir

PATCH_FILE = "agentshare-patch.json"
ADAPTER_FILE = "adapter.safetensors"
_MARKER = "agentshare-patched.json"
FORMAT = "agentshare-base-patch/v1"
DEFAULT_BASE = "default"


def is_patch(path: Path | str) -> bool:
    """Whether ``path`` is a base patch directory (it holds ``agentshare-patch.json``)."""
    return (Path(path) / PATCH_FILE).is_file()


def save_patch(adapter: Mapping[str, tuple[torch.Tensor, torch.Tensor]], out: Path | str, *,
               base: Path | str, scale: float, record: dict | None = None, base_name: str | None = None) -> Path:
    """Write a base patch: ``adapter`` maps each adapted projection of ``base`` (its weight's
    name without ``.weight``) to its ``(lora_A [r, in], lora_B [out, r])``, stored in bf16.
    ``base`` is recorded as ``"default"`` when it is the default model, else as given (or as
    ``base_name``: the patch that built it, where it was built from one). The
    family of the result is computed (by applying the patch once) and recorded, so a rebuild
    anywhere is checked against it."""
    from server.kv.family import family_digest

    if not exact_scale(scale):
        raise ValueError(f"the LoRA scale (alpha / rank) must be a power of two for an exact merge, got {scale}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    ranks = set()
    for name, (a, b) in sorted(adapter.items()):
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not make a rank-r pair")
        ranks.add(a.shape[0])
        tensors[f"{name}.lora_A"] = a.detach().to("cpu", torch.bfloat16).contiguous()
        tensors[f"{name}.lora_B"] = b.detach().to("cpu", torch.bfloat16).contiguous()
    save_file(tensors, out / ADAPTER_FILE)
    named = base_name or (DEFAULT_BASE if _is_default(base) else str(base))
    meta = {"format": FORMAT, "base": named, "base_family": family_digest(base, kv_dtype="float32"),
            "scale": float(scale), "rank": max(ranks, default=0),
            "targets": sorted({n.rsplit(".", 1)[-1] for n in adapter}), "record": record or {}}
    (out / PATCH_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        built = apply_patch(out, Path(tmp) / "base", base=base)
        meta["family"] = family_digest(built, kv_dtype="float32", cache_dir=Path(tmp) / "digests")
    (out / PATCH_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def exact_scale(scale: float) -> bool:
    """Whether a LoRA scale keeps the merge exact: a power of two (1, 2, 0.5, ...)."""
    return scale > 0 and math.frexp(scale)[0] == 0.5


def read_patch(path: Path | str) -> dict:
    """The patch's record, checked for its format."""
    path = Path(path)
    try:
        meta = json.loads((path / PATCH_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a readable base patch ({PATCH_FILE}: {exc})") from exc
    if meta.get("format") != FORMAT:
        raise ModelLoadError(f"{path / PATCH_FILE}: format {meta.get('format')!r}, this version reads {FORMAT!r}")
    return meta


def patch_base(path: Path | str) -> Path:
    """The base model directory the patch applies to (the default model, converted if needed; a
    base that is itself a patch, built)."""
    named = read_patch(path)["base"]
    if named == DEFAULT_BASE:
        return default_model_dir()
    base = Path(named)
    return resolve_model_dir(base if base.is_absolute() else (Path(path) / base))


def apply_patch(path: Path | str, out: Path | str, *, base: Path | str | None = None) -> Path:
    """Write the patched base to ``out``: the base's files copied, its safetensors weights with
    every adapted projection merged exactly (see the module's docstring). ``base`` defaults to
    the one the patch names; it must be of the family the patch records."""
    from server.kv.family import family_digest

    path, out = Path(path), Path(out)
    meta = read_patch(path)
    base = Path(base) if base is not None else patch_base(path)
    found = family_digest(base, kv_dtype="float32")
    if found != meta["base_family"]:
        raise ModelLoadError(f"the base patch {path} applies to a base of family {meta['base_family'][:12]}, "
                             f"but {base} is of family {found[:12]}: give the base it was trained on")
    adapter = load_file(path / ADAPTER_FILE)
    todo = {k[: -len(".lora_A")] for k in adapter if k.endswith(".lora_A")}
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(base.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and not f.name.startswith("agentshare-"):
            shutil.copy2(f, out / f.name)
    for shard in sorted(base.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
            header = fh.metadata()
        for name in sorted(todo):
            if f"{name}.weight" in tensors:
                w = tensors[f"{name}.weight"]
                tensors[f"{name}.weight"] = merge(w, adapter[f"{name}.lora_A"], adapter[f"{name}.lora_B"], meta["scale"])
                todo.discard(name)
        save_file(tensors, out / shard.name, metadata=header)
    if todo:
        raise ModelLoadError(f"the base patch {path} adapts weights {sorted(todo)[:3]} that {base} lacks")
    return out


def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale · B A`` rounded once to ``W``'s dtype; the same bits on every machine: the
    rank-one terms are exact in float64 and summed in order, elementwise.

    >>> w = torch.zeros(2, 2); a = torch.tensor([[1.0, 2.0]]); b = torch.tensor([[3.0], [4.0]])
    >>> merge(w, a, b, 2.0).tolist()
    [[6.0, 12.0], [8.0, 16.0]]
    """
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    delta = torch.zeros(w.shape, dtype=torch.float64)
    for j in range(a64.shape[0]):
        delta += torch.outer(b64[:, j], a64[j]) * scale
    return (w.to(torch.float64) + delta).to(w.dtype)


def resolve_model_dir(path: Path | str | None) -> Path:
    """The model directory a ``--model`` or ``--base`` names: ``None``, the default model;
    a model directory, itself; a base patch, the patched base, built once under
    ``$AGENTSHARE_CACHE_DIR/models/patched-<family>`` and checked against the family the patch
    records."""
    from server.kv.family import family_digest

    if path is None:
        return default_model_dir()
    path = Path(path)
    if not is_patch(path):
        if not (path / "config.json").is_file():  # said here, before any engine's own error
            raise ModelLoadError(f"{path} is not a model directory (no config.json) nor a base patch ({PATCH_FILE})")
        return path
    meta = read_patch(path)
    target = cache_dir() / "models" / f"patched-{meta['family'][:16]}"
    if (target / _MARKER).is_file():
        return target

    def build(tmp: Path) -> None:
        apply_patch(path, tmp)
        with tempfile.TemporaryDirectory() as digests:
            found = family_digest(tmp, kv_dtype="float32", cache_dir=Path(digests))
        if found != meta["family"]:
            raise ModelLoadError(f"the base patch {path} rebuilt a base of family {found[:12]}, not the "
                                 f"{meta['family'][:12]} it records: the patch or its base was changed")
        (tmp / _MARKER).write_text(json.dumps({"patch": str(path.resolve()), "family": found}, indent=2) + "\n")

    return build_atomically(target, _MARKER, build)


def patch_of(model_dir: Path | str) -> Path | None:
    """The base patch that :func:`resolve_model_dir` built ``model_dir`` from; None for any other
    model directory. What a module trained on a patched base names as its base.

    >>> import tempfile
    >>> patch_of(tempfile.mkdtemp()) is None
    True
    """
    marker = Path(model_dir) / _MARKER
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["patch"])


def _is_default(base: Path | str) -> bool:
    """Whether ``base`` is the default model's conversion (known by its marker; nothing is converted)."""
    try:
        marker = json.loads((Path(base) / CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return Path(str(marker.get("source", ""))).name == DEFAULT_GGUF
