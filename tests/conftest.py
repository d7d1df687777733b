"""Shared fixtures: the real SmolLM2 tokenizer and tiny random Llama-family models around it.

Exactness tests run on tiny random weights (fast) but with the real tokenizer and chat
template (so template and invocation-point logic are tested for real). Weights are scaled up
(``initializer_range=0.1``) so attention is peaked rather than uniform: masking or position
bugs then change logits visibly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

TINY_LLAMA: dict[str, Any] = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    initializer_range=0.1,
)


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The real SmolLM2-135M-Instruct tokenizer (with chat template), read from its GGUF."""
    from transformers import AutoTokenizer

    from server.models.loader import default_gguf_path

    gguf = default_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def make_tiny_model(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any
) -> Callable[..., Path]:
    """Factory: ``make_tiny_model(name, **config_overrides) -> model dir`` (fp32, seeded, cached).

    The directory holds config, safetensors weights and the real SmolLM2 tokenizer + template;
    the vocabulary is the tokenizer's. Overrides may change ``model_type`` (llama, qwen2,
    qwen3, mistral) and any config field.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    made: dict[str, tuple[dict[str, Any], Path]] = {}

    def make(name: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        params = {**TINY_LLAMA, **overrides, "seed": seed}
        if name in made:
            assert made[name][0] == params, f"tiny model {name!r} requested with other settings"
            return made[name][1]
        made_params = dict(params)
        params.pop("seed")
        model_type = params.pop("model_type")
        config = AutoConfig.for_model(model_type, vocab_size=len(smollm2_tokenizer), **params)
        with torch.random.fork_rng():  # seeded weights without touching the tests' global RNG
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        model.save_pretrained(path)
        smollm2_tokenizer.save_pretrained(path)
        made[name] = (made_params, path)
        return path

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model: Callable[..., Path]) -> Path:
    """A tiny random Llama (3 layers, hidden 256, 4 q / 2 kv heads of 64, tied embeddings)."""
    return make_tiny_model("llama")
