"""Models of realistic size without a hub: Llama-family shapes with random weights, built where
they will run (a GPU machine's 64 MiB transfer limit keeps real checkpoints away from it).

=================  ======  ======  =====  ==========  =======  =============================
shape              layers  hidden  heads  KV heads    vocab    as
=================  ======  ======  =====  ==========  =======  =============================
``smollm2-135m``   30      576     9      3 (d 64)    49,152   the default model
``llama-1b``       16      2,048   32     8 (d 64)    128,256  Llama 3.2 1B
``llama-8b``       32      4,096   32     8 (d 128)   128,256  Llama 3.1 8B
=================  ======  ======  =====  ==========  =======  =============================

Speed runs use these; exactness runs use tiny configs against transformers on the same device.
The engine needs a decoder only to print text: :class:`IdDecoder` names each id.

>>> core = random_engine(tiny_shape(), loras=2, dtype=torch.float32, device="cpu")
>>> sorted(core.modules), core.modules["agent0"].shares_prefill
(['agent0', 'agent1', 'base'], True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from server.engine.config import EngineConfig
from server.engine.core import EngineCore
from server.engine.device import resolve_device
from server.engine.forward import LlamaForward
from server.engine.modules import DecodeModule, base_module
from server.engine.projection import LowRank

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                     rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
                     tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                     rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
                     tie_word_embeddings=False, rms_norm_eps=1e-5),
}

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_shape(**overrides: Any) -> dict[str, Any]:
    """A 2-layer shape for exactness runs and examples (GQA, tied embeddings)."""
    return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=10000.0,
                tie_word_embeddings=True, rms_norm_eps=1e-5, initializer_range=0.1) | overrides


def _params(shape: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(shape, dict):
        return dict(shape)
    try:
        return dict(SHAPES[shape])
    except KeyError:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}") from None


def random_hf_model(shape: str | dict[str, Any], *, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu", seed: int = 0) -> torch.nn.Module:
    """A transformers ``LlamaForCausalLM`` of ``shape`` with seeded random weights, built on
    ``device`` in ``dtype`` (never materialised elsewhere first), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_params(shape))
    dev = resolve_device(device) if isinstance(device, str) else device
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with dev:
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
    return model.eval()


def random_lora(forward: LlamaForward, *, rank: int = 16, seed: int = 0, std: float = 0.02,
                targets: Sequence[str] = LORA_TARGETS) -> dict[tuple[int, str], list[LowRank]]:
    """Random low-rank updates on ``targets`` of every layer, as a LoRA module's loaded deltas
    (in the forward's dtype and device)."""
    w, s = forward.weights, forward.weights.shape
    inter = w.layers[0].gate_up.weight.shape[0] // 2
    where = {"q_proj": ("qkv", 0, s.hidden_size, s.q_size), "k_proj": ("qkv", s.q_size, s.hidden_size, s.kv_size),
             "v_proj": ("qkv", s.q_size + s.kv_size, s.hidden_size, s.kv_size),
             "o_proj": ("o", 0, s.q_size, s.hidden_size), "gate_proj": ("gate_up", 0, s.hidden_size, inter),
             "up_proj": ("gate_up", inter, s.hidden_size, inter), "down_proj": ("down", 0, inter, s.hidden_size)}
    g = torch.Generator(device="cpu").manual_seed(seed)
    deltas: dict[tuple[int, str], list[LowRank]] = {}
    for layer in range(s.num_layers):
        for t in targets:
            fused, col, fan_in, fan_out = where[t]
            a = (torch.randn(rank, fan_in, generator=g) * std).to(device=w.device, dtype=w.dtype)
            b = (torch.randn(fan_out, rank, generator=g) * std).to(device=w.device, dtype=w.dtype)
            deltas.setdefault((layer, fused), []).append(LowRank(a=a, b=b, scale=2.0, col=col))
    return deltas


class IdDecoder:
    """A decoder for models without a tokenizer: every id prints as ``<id>``."""

    def decode(self, ids: Sequence[int], **kwargs: object) -> str:
        return "".join(f"<{i}>" for i in ids)


def random_engine(shape: str | dict[str, Any], *, loras: int = 0, rank: int = 16, dtype: torch.dtype = torch.bfloat16,
                  device: str | torch.device = "auto", config: EngineConfig = EngineConfig(), seed: int = 0,
                  model: torch.nn.Module | None = None) -> EngineCore:
    """An engine serving a random model of ``shape`` as ``base`` and ``loras`` random LoRA
    modules ``agent0..`` that share its prefill (family ``random-<seed>``). ``model``: that
    random model, already built (:func:`random_hf_model`), to share its weights."""
    dev = resolve_device(device) if isinstance(device, str) else device
    hf = model if model is not None else random_hf_model(shape, dtype=dtype, device=dev, seed=seed)
    forward = LlamaForward.from_hf(hf, dtype=dtype, device=dev)
    family = f"random-{seed}"
    table = {"base": base_module(family)}
    for i in range(loras):
        table[f"agent{i}"] = DecodeModule(f"agent{i}", "lora", f"{family}-lora{i}", True,
                                          weights=random_lora(forward, rank=rank, seed=seed * 1000 + i + 1),
                                          reason="a random LoRA module of the family")
    return EngineCore(forward, IdDecoder(), family=family, modules=table, config=config)
