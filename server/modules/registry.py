"""Decode modules as the engine serves them: loaded, identified, and sorted into shared or private.

A module directory holds its weights and, if it was trained for sharing, a manifest::

    coder/
      agentshare-module.json        kind, family digest, invocation placement (manifest.py)
      adapter_config.json           } kind "lora": a peft-format adapter (r, lora_alpha,
      adapter_model.safetensors     }   target_modules); read directly, no peft at serving time
      config.json + *.safetensors     kind "full": a fine-tuned copy of the base

Who computes what (DESIGN §2):

==========================================  ===============================================
module                                      positions < IP            positions >= IP
==========================================  ===============================================
the base                                    base (shared)             base
manifest naming the serving family          base (shared)             the module
no manifest, or another family              the module (private prefill, IP = 0)
==========================================  ===============================================
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from server.engine.projection import LowRank
from server.engine.weights import ModelShape, ModelWeights
from server.kv.family import weights_digest
from server.modules.manifest import MANIFEST_FILE, Manifest, ManifestError, ModuleKind
from server.prompt import Placement

# peft target name -> (fused projection, which slice of its output)
_LORA_TARGETS = {
    "q_proj": ("qkv", "q"),
    "k_proj": ("qkv", "k"),
    "v_proj": ("qkv", "v"),
    "o_proj": ("o", None),
    "gate_proj": ("gate_up", "gate"),
    "up_proj": ("gate_up", "up"),
    "down_proj": ("down", None),
}


class ModuleLoadError(ValueError):
    """A module directory that cannot be served; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True, eq=False)
class DecodeModule:
    """One servable decode module.

    ``shares_prefill``: its positions before the IP are computed by the family's base and
    shared. Otherwise it has a private prefill: IP 0, every position its own.
    """

    name: str
    kind: ModuleKind
    digest: str  # identity of the module's weights + manifest: its KV namespace owner
    shares_prefill: bool
    placement: Placement = Placement.TURN
    deltas: dict[tuple[int, str], list[LowRank]] = field(default_factory=dict)  # lora
    weights: ModelWeights | None = None  # full
    reason: str = ""  # why a module does not share (for logs and /v1/agents)

    @property
    def is_base(self) -> bool:
        return self.kind is ModuleKind.BASE


def base_module(family: str, name: str = "base") -> DecodeModule:
    """The base model as a decode module: shares everything, computes everything with the base."""
    return DecodeModule(name, ModuleKind.BASE, family, shares_prefill=True, reason="the base")


def load_module(
    path: Path | str, *, name: str, family: str, shape: ModelShape, dtype: torch.dtype
) -> DecodeModule:
    """Load the module in ``path`` for serving beside a base of ``family`` with ``shape``."""
    d = Path(path)
    if not d.is_dir():
        raise ModuleLoadError(f"module {name!r}: {d} is not a directory")
    try:
        manifest = Manifest.read(d)
    except ManifestError as exc:  # unreadable manifest: refuse loudly rather than guess
        raise ModuleLoadError(f"module {name!r}: {exc}") from exc
    kind = manifest.kind if manifest else _guess_kind(d)
    if kind is None:
        raise ModuleLoadError(
            f"module {name!r}: {d} holds neither a peft adapter (adapter_model.safetensors) "
            f"nor a model (config.json + *.safetensors), and no {MANIFEST_FILE}"
        )
    shards = sorted(d.glob("adapter_model.safetensors" if kind is ModuleKind.LORA else "*.safetensors"))
    digest = _module_digest(d, manifest, shards)
    if manifest is None:
        shares, reason = False, f"no {MANIFEST_FILE}: private prefill"
    elif manifest.family != family:
        shares, reason = False, f"manifest names family {manifest.family[:12]}…, not the server's {family[:12]}…: private prefill"
    else:
        shares, reason = True, f"joins family {family[:12]}…"
    placement = manifest.invocation if manifest else Placement.TURN
    if kind is ModuleKind.BASE:
        return DecodeModule(name, kind, family, True, placement, reason="the base")
    if kind is ModuleKind.LORA:
        deltas = _load_lora(d, name, shape, dtype)
        return DecodeModule(name, kind, digest, shares, placement, deltas=deltas, reason=reason)
    weights = _load_full(d, name, shape, dtype)
    return DecodeModule(name, kind, digest, shares, placement, weights=weights, reason=reason)


def _guess_kind(d: Path) -> ModuleKind | None:
    if (d / "adapter_model.safetensors").exists():
        return ModuleKind.LORA
    if (d / "config.json").exists() and any(d.glob("*.safetensors")):
        return ModuleKind.FULL
    return None


def _module_digest(d: Path, manifest: Manifest | None, shards: list[Path]) -> str:
    h = hashlib.sha256(b"agentshare/module/v1\n")
    h.update((manifest.to_json() if manifest else "no-manifest").encode())
    for extra in ("adapter_config.json", "config.json"):
        if (d / extra).exists():
            h.update((d / extra).read_bytes())
    if shards:
        h.update(weights_digest(shards).encode())
    return h.hexdigest()


def _load_lora(d: Path, name: str, shape: ModelShape, dtype: torch.dtype) -> dict[tuple[int, str], list[LowRank]]:
    cfg_path, weights_path = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not cfg_path.exists() or not weights_path.exists():
        raise ModuleLoadError(f"module {name!r}: a lora module needs adapter_config.json and adapter_model.safetensors in {d}")
    cfg = json.loads(cfg_path.read_text())
    rank, alpha = int(cfg.get("r", 0)), float(cfg.get("lora_alpha", 0))
    if rank <= 0:
        raise ModuleLoadError(f"module {name!r}: {cfg_path} has no positive 'r'")
    scale = alpha / (rank**0.5 if cfg.get("use_rslora") else rank)
    tensors = load_file(weights_path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        # e.g. base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
        parts = key.split(".")
        try:
            layer = int(parts[parts.index("layers") + 1])
            target = next(p for p in parts if p in _LORA_TARGETS)
            ab = next(p for p in parts if p in ("lora_A", "lora_B"))
        except (ValueError, StopIteration):
            raise ModuleLoadError(f"module {name!r}: unexpected tensor {key!r} in {weights_path}") from None
        pairs.setdefault((layer, target), {})[ab] = t
    deltas: dict[tuple[int, str], list[LowRank]] = {}
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"} or not (0 <= layer < shape.num_layers):
            raise ModuleLoadError(f"module {name!r}: incomplete or out-of-range adapter for layer {layer} {target}")
        fused, part = _LORA_TARGETS[target]
        a, b = ab["lora_A"].to(dtype), ab["lora_B"].to(dtype)
        # where the target's output sits inside the fused projection's output
        col = {"k": shape.q_size, "v": shape.q_size + shape.kv_size, "up": b.shape[0]}.get(part or "", 0)
        deltas.setdefault((layer, fused), []).append(LowRank(a=a, b=b, scale=scale, col=col))
    if not deltas:
        raise ModuleLoadError(f"module {name!r}: {weights_path} holds no LoRA tensors")
    return deltas


def _load_full(d: Path, name: str, shape: ModelShape, dtype: torch.dtype) -> ModelWeights:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ModuleLoadError(f"module {name!r}: cannot load the full model in {d}: {exc}") from exc
    weights = ModelWeights.from_hf(model, dtype=dtype)
    s = weights.shape
    if (s.num_layers, s.num_kv_heads, s.head_dim) != (shape.num_layers, shape.num_kv_heads, shape.head_dim):
        raise ModuleLoadError(
            f"module {name!r}: its KV shape ({s.num_layers} layers x {s.num_kv_heads} heads x "
            f"{s.head_dim}) differs from the base's; it cannot share the server's KV pool"
        )
    return weights
