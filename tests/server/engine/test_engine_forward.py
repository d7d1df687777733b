"""The engine's own forward vs transformers' forward (fp32, tiny random models)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from server.engine import weights
from server.engine.batch import Chunk, plan_step
from server.engine.forward import Join, LlamaForward
from server.engine.rope import Rope, UnsupportedRopeError
from server.engine.weights import (
    Linear,
    ModelShape,
    ModelWeights,
    UnsupportedModelError,
    can_pack,
    pack_linear,
)
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


def test_packing_where_it_cannot_pay_is_refused_naming_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 is never packed (the oracle paths keep F.linear); bf16 is refused on a CPU without
    native bf16, where oneDNN itself refuses bf16 without AVX-512 (seen on an AVX2-only EPYC)."""
    with pytest.raises(ValueError, match=r"cannot pack a torch\.float32 linear on cpu: .*native bf16 \(can_pack\)"):
        pack_linear(Linear(torch.randn(4, 8)))
    monkeypatch.setattr(weights, "cpu_has_native_bf16", lambda: False)
    assert not can_pack(torch.bfloat16)
    with pytest.raises(ValueError, match=r"cannot pack a torch\.bfloat16 linear on cpu"):
        pack_linear(Linear(torch.randn(4, 8, dtype=torch.bfloat16)))
    tiny = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    plain = ModelWeights.from_hf(LlamaForCausalLM(tiny), dtype=torch.bfloat16)  # pack=None: where it pays
    assert plain.layers[0].qkv.kernel == "torch"


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
    assert packed.weights.layers[0].qkv.kernel.startswith("onednn") and plain.weights.layers[0].qkv.kernel == "torch"
    assert packed.weights.layers[0].gate_up.weight.device.type == "meta"
    ids = _prompt(smollm2_tokenizer)

    def logits(fwd: LlamaForward) -> torch.Tensor:
        kv = KVStorage(fwd.kv_spec(), num_blocks=ids.numel() // 16 + 1, block_size=16)
        plan = plan_step([Chunk(ids, start=0, slots=torch.arange(ids.numel()))], block_size=16, all_logits=True)
        return fwd(plan, kv).float()

    a, b = logits(packed), logits(plain)
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


def _joins_setup():
    """A tiny 3-layer model and a pool that keeps the input of layers 1 and 2; sequence A (20
    tokens) prefilled at slots 0..19."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    from transformers import LlamaForCausalLM

    fwd = LlamaForward.from_hf(LlamaForCausalLM(cfg).eval())
    kv = KVStorage(fwd.kv_spec(), num_blocks=8, block_size=16, hidden_depths=(1, 2), hidden_width=32)
    a = torch.randint(0, 64, (20,))
    fwd(plan_step([Chunk(a, 0, torch.arange(20))], block_size=16), kv)
    return fwd, kv


def _copy_lower(kv, src, dst, split):
    for layer in range(split):
        kv.k[layer][:, dst] = kv.k[layer][:, src]
        kv.v[layer][:, dst] = kv.v[layer][:, src]


def test_rows_that_join_at_their_layer_compute_what_calls_of_their_own_compute():
    """B (10 new tokens, from layer 0) and C (A's first 16 positions again, in other slots, from
    A's hidden state at layer 2) in one forward, C joining at layer 2, give the logits and K/V
    of B's call and C's call run one after the other."""
    b_ids = torch.randint(0, 64, (10,))
    c_src, c_dst = torch.arange(16), torch.arange(64, 80)
    b = Chunk(b_ids, 0, torch.arange(32, 42))
    c = Chunk(torch.zeros(16, dtype=torch.long), 0, c_dst)  # its ids are never read: it starts at layer 2

    fwd, kv = _joins_setup()
    _copy_lower(kv, c_src, c_dst, 2)
    apart = torch.cat([fwd(plan_step([b], block_size=16), kv),
                       fwd(plan_step([c], block_size=16), kv, first_layer=2, hidden=kv.hidden[2][c_src])])
    kept = [t[:, 32:80].clone() for t in (*kv.k, *kv.v)]

    fwd, kv = _joins_setup()
    _copy_lower(kv, c_src, c_dst, 2)
    joined = fwd(plan_step([b], block_size=16), kv,
                 joins=[Join(2, kv.hidden[2][c_src].clone(), plan_step([b, c], block_size=16))])
    assert torch.allclose(joined, apart, atol=1e-5)
    for before, now in zip(kept, (*kv.k, *kv.v), strict=True):
        assert torch.allclose(now[:, 32:80], before, atol=1e-5)


@pytest.mark.parametrize("first, layers", [(0, [0]), (2, [1]), (1, [2, 2]), (0, [3])])
def test_joins_above_the_start_in_ascending_order_only(first, layers):
    fwd, kv = _joins_setup()
    plan = plan_step([Chunk([1, 2], 0, torch.arange(40, 42))], block_size=16)
    joins = [Join(layer, torch.zeros(1, 32), plan) for layer in layers]
    with pytest.raises(ValueError, match="join at layers"):
        fwd(plan, kv, first_layer=first, hidden=None if first == 0 else torch.zeros(2, 32), joins=joins)
