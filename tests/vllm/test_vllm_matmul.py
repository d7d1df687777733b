"""The torch engine's bf16 linears on vLLM's oneDNN matmul (server/engine/vllm_matmul.py), where
the vllm extra is installed: the same numbers as torch's inner product, for any row count and
through the whole engine, and the packed weights freed with their linears."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from server.engine import vllm_matmul
from server.engine.build import load_engine
from server.engine.core import EngineConfig
from server.engine.sampling import SamplingParams
from server.engine.weights import Linear, pack_linear
from server.prompt import text_prompt

pytestmark = pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="vLLM's CPU ops need AVX512-BF16")


def test_it_is_on_where_the_vllm_package_is() -> None:
    assert vllm_matmul.status() == "on", vllm_matmul.status()


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 513, 2048])
def test_a_linear_on_the_matmul_computes_what_the_inner_product_computes(rows: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(rows)
    plain = Linear(torch.randn(320, 576, dtype=torch.bfloat16) * 0.05, torch.randn(320, dtype=torch.bfloat16))
    matmul = pack_linear(plain)
    monkeypatch.setattr(vllm_matmul, "available", lambda: False)
    inner = pack_linear(plain)
    assert (matmul.kernel, inner.kernel) == ("onednn-matmul", "onednn-inner-product")
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    want, got, ref = inner(x).float(), matmul(x).float(), (x.float() @ plain.weight.float().T + plain.bias.float())
    assert got.shape == (rows, 320)
    assert (got - want).abs().max() <= 0.02 * ref.abs().max()  # bf16 rounding of the output at most
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
    assert matmul(x[::2]).shape == (len(range(0, rows, 2)), 320)  # a strided view of the rows


def test_a_packed_weight_is_freed_with_its_linear() -> None:
    lin = pack_linear(Linear(torch.randn(64, 32, dtype=torch.bfloat16)))
    assert lin.matmul is not None
    release = lin.matmul.release
    assert release.alive
    del lin
    gc.collect()
    assert not release.alive


@pytest.mark.timeout(300)
def test_the_engine_decodes_the_same_tokens_on_either_kernel(base_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model in bf16, greedy, 24 tokens: the same ids on the matmul as on the inner
    product (measured: the same logits, bit for bit)."""
    config = EngineConfig(kv_cache_bytes=64 << 20)

    def decode() -> list[object]:
        core = load_engine(base_dir, dtype="bfloat16", config=config)
        prompt = text_prompt(core.tokenizer, "Write a Python function that reverses a list, then explain it.")
        core.add_request("r", "base", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        ids = []
        while core.has_work:
            ids += [e.token_id for e in core.step() if e.token_id is not None]
        return [core.forward.weights.layers[0].qkv.kernel, *ids]

    on = decode()
    monkeypatch.setattr(vllm_matmul, "available", lambda: False)
    off = decode()
    assert on[0] == "onednn-matmul" and off[0] == "onednn-inner-product"
    assert on[1:] == off[1:] and len(on) == 25


@pytest.mark.timeout(300)
def test_the_benchmark_runs_and_finds_the_same_logits(tmp_path: Path) -> None:
    """benchmarks/engine_linears.py, cut short: it writes both arms' figures and the comparison."""
    import json
    import subprocess
    import sys

    out = tmp_path / "linears.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_linears.py"
    proc = subprocess.run([sys.executable, str(script), "--reps", "1", "--context", "64", "--steps", "2",
                           "--rows", "3", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"prefill 64", "decode 3 rows"}
    for row in runs.values():
        assert row["same_argmax"] and row["ms_per_step"]["inner"] > 0 and row["ms_per_step"]["matmul"] > 0
