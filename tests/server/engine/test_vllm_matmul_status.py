"""Whether the engine's bf16 linears run on vLLM's oneDNN matmul, and why not (its use is tested
in tests/vllm/test_vllm_matmul.py, where the vllm extra is installed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from server.engine import vllm_matmul
from server.engine.weights import Linear, pack_linear


@pytest.fixture
def fresh_status():
    vllm_matmul.status.cache_clear()
    yield
    vllm_matmul.status.cache_clear()


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
