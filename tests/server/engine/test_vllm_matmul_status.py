"""Whether the engine's bf16 linears run on vLLM's oneDNN matmul, and its decode steps on vLLM's
attention kernel, and why not (their use is tested in tests/vllm/test_vllm_matmul.py and
tests/vllm/test_vllm_attention.py, where the vllm extra is installed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from server.engine import vllm_attention, vllm_matmul
from server.engine.weights import Linear, pack_linear


@pytest.fixture
def fresh_status():
    vllm_matmul.status.cache_clear()
    vllm_attention.status.cache_clear()
    yield
    vllm_matmul.status.cache_clear()
    vllm_attention.status.cache_clear()


def test_it_can_be_turned_off(fresh_status, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTSHARE_VLLM_MATMUL", "off")
    assert vllm_matmul.status() == "off (AGENTSHARE_VLLM_MATMUL)" and not vllm_matmul.available()
    with pytest.raises(RuntimeError, match="not available here: off"):
        vllm_matmul.pack(torch.zeros(2, 2, dtype=torch.bfloat16))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="the vllm package is installed here")
def test_without_the_vllm_package_it_says_so_and_linears_stay_on_the_inner_product(fresh_status) -> None:
    said = vllm_matmul.status()
    assert said.startswith("off:") and ("not installed" in said or "AVX512-BF16" in said), said
    lin = pack_linear(Linear(torch.randn(8, 4, dtype=torch.bfloat16)))
    assert lin.matmul is None and lin.kernel == "onednn-inner-product"


def test_the_decode_attention_kernel_can_be_turned_off_and_then_serves_no_step(fresh_status,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTSHARE_VLLM_ATTENTION", "off")
    assert vllm_attention.status() == "off (AGENTSHARE_VLLM_ATTENTION)"
    assert not vllm_attention.serves(torch.bfloat16, "cpu")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="the vllm package is installed here")
def test_without_the_vllm_package_decode_steps_keep_the_cascade(fresh_status) -> None:
    said = vllm_attention.status()
    assert said.startswith("off:") and ("not installed" in said or "AVX512-BF16" in said), said
    assert not vllm_attention.serves(torch.bfloat16, "cpu")
