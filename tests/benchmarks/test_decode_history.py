"""benchmarks/decode_history.py on a tiny fp32 model: both arms lay out what they claim and
compute the same logits (views of long histories are the gather's attention, without the copy)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from server.engine.forward import LlamaForward
from tests.benchmarks.scripts import load_script


def test_the_views_arm_and_the_gathered_arm_decode_the_same_logits() -> None:
    bench = load_script("decode_history")
    cfg = LlamaConfig(vocab_size=40960, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    torch.manual_seed(0)
    fwd = LlamaForward.from_hf(LlamaForCausalLM(cfg).eval(), dtype=torch.float32)
    with torch.inference_mode():
        gathered = bench.workload(fwd, 2, 300, 3, views=False)()  # asserts its plans gather
        views = bench.workload(fwd, 2, 300, 3, views=True)()  # and these read views
    assert len(gathered) == len(views) == 3
    for a, b in zip(gathered, views, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
