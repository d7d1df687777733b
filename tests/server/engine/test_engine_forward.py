"""The engine's own forward vs transformers' forward (fp32, tiny random models)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from server.engine.batch import Chunk, plan_step
from server.engine.forward import LlamaForward
from server.engine.rope import Rope, UnsupportedRopeError
from server.engine.weights import ModelShape, UnsupportedModelError, can_pack
from server.kv.storage import KVStorage

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so the tiny model's positions cross bands
}

VARIANTS: dict[str, dict] = {
    "llama": {},
    "llama-untied-bias-llama3rope": dict(
        tie_word_embeddings=False, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE
    ),
    "llama-linear-rope-mha": dict(
        num_key_value_heads=4, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    ),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3"),
    "mistral": dict(model_type="mistral", sliding_window=None),
}


def _prompt(tokenizer, n: int | None = None) -> torch.Tensor:
    text = "The shared context: a table of eight records, each with a name and a city. " * 4
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    return ids if n is None else ids[:n]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(
    variant: str, make_tiny_model: Callable[..., Path], smollm2_tokenizer
) -> None:
    path = make_tiny_model(variant, **VARIANTS[variant])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _prompt(smollm2_tokenizer)
    assert ids.numel() > 64
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
    fwd = LlamaForward.from_hf(model)
    kv = KVStorage(fwd.kv_spec(), num_blocks=16, block_size=16)
    slots = kv.slots([9, 3, 12, 0, 5, 7, 1, 2, 4, 6, 8, 10])[: ids.numel()]
    got = fwd(plan_step([Chunk(ids, start=0, slots=slots)], block_size=16, all_logits=True), kv)
    assert got.shape == expected.shape
    assert expected.abs().max() > 1.0  # the random model is not trivially flat
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_llama3_rope_frequencies_match_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(head_dim=64, hidden_size=256, num_attention_heads=4,
                      max_position_embeddings=4096, rope_parameters=LLAMA3_ROPE)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(Rope.from_config(cfg, 64).inv_freq, theirs.float())


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_is_a_clear_error(kind: str) -> None:
    with pytest.raises(UnsupportedRopeError, match=kind):
        Rope.from_config_dict({"rope_type": kind, "factor": 2.0}, head_dim=64)


def test_unsupported_architecture_is_a_clear_error() -> None:
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelShape.from_config(GPT2Config())
    with pytest.raises(UnsupportedModelError, match="gelu"):
        ModelShape.from_config(LlamaConfig(hidden_act="gelu"))


def test_sliding_window_caps_the_context() -> None:
    from transformers import MistralConfig

    shape = ModelShape.from_config(MistralConfig(sliding_window=512, max_position_embeddings=4096))
    assert shape.max_context == 512


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN packing needs a CPU with native bf16")
@pytest.mark.parametrize("variant", ["llama", "llama-untied-bias-llama3rope"])
def test_bf16_packed_linears_compute_what_plain_linears_compute(
    variant: str, make_tiny_model: Callable[..., Path], smollm2_tokenizer
) -> None:
    """Packing (bf16 on a CPU with native bf16) changes the kernel, not the model: the same
    logits as ``F.linear`` within bf16 rounding, and the plain weights are released."""
    path = make_tiny_model(variant, **VARIANTS[variant])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    packed = LlamaForward.from_hf(model, dtype=torch.bfloat16)
    plain = LlamaForward.from_hf(model, dtype=torch.bfloat16, pack=False)
    assert packed.weights.layers[0].qkv.packed is not None and plain.weights.layers[0].qkv.packed is None
    assert packed.weights.layers[0].gate_up.weight.device.type == "meta"
    ids = _prompt(smollm2_tokenizer)

    def logits(fwd: LlamaForward) -> torch.Tensor:
        kv = KVStorage(fwd.kv_spec(), num_blocks=ids.numel() // 16 + 1, block_size=16)
        plan = plan_step([Chunk(ids, start=0, slots=torch.arange(ids.numel()))], block_size=16, all_logits=True)
        return fwd(plan, kv).float()

    a, b = logits(packed), logits(plain)
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95
