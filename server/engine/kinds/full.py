"""A fully fine-tuned copy of the base: from the invocation point on, its rows run in a forward
of its own weights, apart from the base's call (the scheduler cuts chunks at the IP)."""

from __future__ import annotations

from pathlib import Path

import torch

from server.engine.kinds.api import Loaded, Runner
from server.engine.weights import ModelShape, ModelWeights
from server.modules.registry import ModuleLoadError


class Full:
    name = "full"
    own_forward = True

    def load(self, path: Path, *, name: str, shape: ModelShape, dtype: torch.dtype,
             device: torch.device = torch.device("cpu")) -> ModelWeights:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise ModuleLoadError(f"module {name!r}: cannot load the full model in {path}: {exc}") from exc
        weights = ModelWeights.from_hf(model, dtype=dtype, device=device)
        s = weights.shape
        if (s.num_layers, s.num_kv_heads, s.head_dim) != (shape.num_layers, shape.num_kv_heads, shape.head_dim):
            raise ModuleLoadError(
                f"module {name!r}: its KV shape ({s.num_layers} layers x {s.num_kv_heads} heads x "
                f"{s.head_dim}) differs from the base's; it cannot share the server's KV pool"
            )
        return weights

    def attach(self, runner: Runner, module: Loaded) -> None:
        runner.add_forward(module.name, module.weights)
