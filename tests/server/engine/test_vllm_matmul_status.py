"""Whether the engine's bf16 linears run on vLLM's oneDNN matmul, its decode steps on vLLM's
attention kernel and elementwise ops, and why not (their use is tested in tests/vllm/test_vllm_matmul.py,
tests/vllm/test_vllm_attention.py and tests/vllm/test_vllm_elementwise.py, where the vllm extra
is installed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from server.engine import vllm_attention, vllm_elementwise, vllm_matmul, vllm_ops
from server.engine.forward import LlamaForward
from server.engine.weights import Linear, can_pack, pack_linear

NO_OPS = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None or vllm_ops.fetched_library() is not None,
                            reason="vLLM's CPU ops are here (the vllm package, or fetched by agentshare kernels)")


@pytest.fixture
def fresh_status():
    statuses = (vllm_matmul.status, vllm_attention.status, vllm_elementwise.status)
    for status in statuses:
        status.cache_clear()
    yield
    for status in statuses:
        status.cache_clear()


def test_it_can_be_turned_off(fresh_status, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTSHARE_VLLM_MATMUL", "off")
    assert vllm_matmul.status() == "off (AGENTSHARE_VLLM_MATMUL)" and not vllm_matmul.available()
    with pytest.raises(RuntimeError, match="not available here: off"):
        vllm_matmul.pack(torch.zeros(2, 2, dtype=torch.bfloat16))


@NO_OPS
@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN packing needs a CPU with native bf16")
def test_without_the_vllm_package_it_says_so_and_linears_stay_on_the_inner_product(fresh_status) -> None:
    said = vllm_matmul.status()
    assert said.startswith("off:") and ("neither the vllm package" in said or "AVX512-BF16" in said), said
    lin = pack_linear(Linear(torch.randn(8, 4, dtype=torch.bfloat16)))
    assert lin.matmul is None and lin.kernel == "onednn-inner-product"


def test_the_decode_attention_kernel_can_be_turned_off_and_then_serves_no_step(fresh_status,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTSHARE_VLLM_ATTENTION", "off")
    assert vllm_attention.status() == "off (AGENTSHARE_VLLM_ATTENTION)"
    assert not vllm_attention.serves(torch.bfloat16, "cpu", 64)


@NO_OPS
def test_without_the_vllm_package_decode_steps_keep_the_cascade(fresh_status) -> None:
    said = vllm_attention.status()
    assert said.startswith("off:") and ("neither the vllm package" in said or "AVX512-BF16" in said), said
    assert not vllm_attention.serves(torch.bfloat16, "cpu", 64)


@NO_OPS
def test_without_the_vllm_package_decode_steps_keep_torchs_elementwise_ops(fresh_status, tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    said = vllm_elementwise.status()
    assert said.startswith("off:") and ("neither the vllm package" in said or "AVX512-BF16" in said), said
    fwd = LlamaForward.from_hf(AutoModelForCausalLM.from_pretrained(tiny_model_dir), dtype=torch.bfloat16)
    assert fwd.small is None and not vllm_elementwise.serves(fwd.weights)


def test_heads_the_kernels_refuse_keep_the_cascade() -> None:
    """vLLM's attention kernels take head sizes in multiples of 32 and refuse others at their first
    call ("invalid head_size 16"): such a model's decode steps keep the cascade, library or not."""
    for head_dim in (16, 48, 80):
        assert not vllm_attention.serves(torch.bfloat16, "cpu", head_dim)
