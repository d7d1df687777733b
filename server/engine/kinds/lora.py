"""Low-rank adapters (peft format, read directly): from the invocation point on, a module's
rows run inside the base's call, each row adding its own module's deltas."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from server.engine.kinds.api import Loaded, Runner
from server.engine.projection import LowRank
from server.engine.weights import ModelShape
from server.modules.registry import ModuleLoadError

# peft target name -> (fused projection, which slice of its output)
_TARGETS = {
    "q_proj": ("qkv", "q"),
    "k_proj": ("qkv", "k"),
    "v_proj": ("qkv", "v"),
    "o_proj": ("o", None),
    "gate_proj": ("gate_up", "gate"),
    "up_proj": ("gate_up", "up"),
    "down_proj": ("down", None),
}

Deltas = dict[tuple[int, str], list[LowRank]]
"""Low-rank updates by (layer, fused projection)."""


class Lora:
    name = "lora"
    own_forward = False

    def load(self, path: Path, *, name: str, shape: ModelShape, dtype: torch.dtype,
             device: torch.device = torch.device("cpu")) -> Deltas:
        cfg_path, weights_path = path / "adapter_config.json", path / "adapter_model.safetensors"
        if not cfg_path.exists() or not weights_path.exists():
            raise ModuleLoadError(f"module {name!r}: a lora module needs adapter_config.json and adapter_model.safetensors in {path}")
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
                target = next(p for p in parts if p in _TARGETS)
                ab = next(p for p in parts if p in ("lora_A", "lora_B"))
            except (ValueError, StopIteration):
                raise ModuleLoadError(f"module {name!r}: unexpected tensor {key!r} in {weights_path}") from None
            pairs.setdefault((layer, target), {})[ab] = t
        deltas: Deltas = {}
        for (layer, target), pair in sorted(pairs.items()):
            if set(pair) != {"lora_A", "lora_B"} or not (0 <= layer < shape.num_layers):
                raise ModuleLoadError(f"module {name!r}: incomplete or out-of-range adapter for layer {layer} {target}")
            fused, part = _TARGETS[target]
            a, b = pair["lora_A"].to(device=device, dtype=dtype), pair["lora_B"].to(device=device, dtype=dtype)
            # where the target's output sits inside the fused projection's output
            col = {"k": shape.q_size, "v": shape.q_size + shape.kv_size, "up": b.shape[0]}.get(part or "", 0)
            deltas.setdefault((layer, fused), []).append(LowRank(a=a, b=b, scale=scale, col=col))
        if not deltas:
            raise ModuleLoadError(f"module {name!r}: {weights_path} holds no LoRA tensors")
        return deltas

    def attach(self, runner: Runner, module: Loaded) -> None:
        runner.add_deltas(module.name, module.weights)
