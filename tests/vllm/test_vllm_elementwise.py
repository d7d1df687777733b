"""A layer's elementwise regions through vLLM's CPU ops (server/engine/vllm_elementwise.py), where
the vllm extra is installed: each as close to fp32 as torch's eager ops, in place where it says
so, and a forward's logits as close to fp32's as the eager forward's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from server.engine import vllm_elementwise
from server.engine.batch import Chunk, SharedPrefix, plan_step
from server.engine.elementwise import FUSED_MIN_ROWS, TorchRegions, eager_kernels, eager_regions
from server.engine.forward import LlamaForward
from server.engine.rope import Rope, apply_rope
from server.engine.vllm_elementwise import VllmRegions
from server.kv.storage import KVStorage

pytestmark = pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="vLLM's CPU ops need AVX512-BF16")

BLOCK = 16
EPS = 1e-5


def _llama(seed: int = 0, layers: int = 3) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=512, hidden_size=384, intermediate_size=768, num_hidden_layers=layers,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      rms_norm_eps=EPS)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def test_it_serves_bf16_llama_layers_on_the_cpu_only() -> None:
    assert vllm_elementwise.status() == "on", vllm_elementwise.status()
    model = _llama()
    bf16 = LlamaForward.from_hf(model, dtype=torch.bfloat16)
    assert isinstance(bf16.small, VllmRegions) and isinstance(bf16.regions(3), VllmRegions)
    assert LlamaForward.from_hf(model, dtype=torch.float32).small is None  # fp32 (the oracle tests): eager
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32))
    assert LlamaForward.from_hf(qwen3, dtype=torch.bfloat16).small is None  # q/k norms: the eager path


def test_the_switch_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTSHARE_VLLM_ELEMENTWISE", "off")
    vllm_elementwise.status.cache_clear()
    try:
        assert vllm_elementwise.status() == "off (AGENTSHARE_VLLM_ELEMENTWISE)"
        assert LlamaForward.from_hf(_llama(), dtype=torch.bfloat16).small is None
    finally:
        monkeypatch.delenv("AGENTSHARE_VLLM_ELEMENTWISE")
        vllm_elementwise.status.cache_clear()


def _regions(hidden: int = 576, heads: int = 12, head_dim: int = 64) -> tuple[VllmRegions, TorchRegions, Rope]:
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=heads // 4, head_dim=head_dim,
                      max_position_embeddings=4096, rms_norm_eps=EPS, rope_theta=100000.0)
    fwd = LlamaForward.from_hf(LlamaForCausalLM(cfg), dtype=torch.bfloat16)
    assert isinstance(fwd.small, VllmRegions)
    return fwd.small, eager_regions(EPS), fwd.rope


def _errors(got: torch.Tensor, eager: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    return (got.float() - want).abs().max().item(), (eager.float() - want).abs().max().item()


@pytest.mark.parametrize("rows", [1, 3, 70])
def test_each_region_is_as_close_to_fp32_as_the_eager_ops(rows: int) -> None:
    ops, eager, _ = _regions()
    g = torch.Generator().manual_seed(rows)
    h, delta = (torch.randn(rows, 576, generator=g) * 3).bfloat16(), torch.randn(rows, 576, generator=g).bfloat16()
    weight = (torch.rand(576, generator=g) + 0.5).bfloat16()

    def norm32(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()

    got, err = _errors(ops.rms_norm(h, weight), eager.rms_norm(h, weight), norm32(h))
    assert got <= 1.5 * err + 1e-3 and got < 0.05, (got, err)

    summed = (h.float() + delta.float()).bfloat16()  # the residual stream is bf16 either way
    h2, d2 = h.clone(), delta.clone()
    new_h, x = ops.add_rms_norm(h2, d2, weight)
    eager_h, eager_x = eager.add_rms_norm(h, delta, weight)
    assert torch.equal(new_h, summed) and torch.equal(eager_h, summed)
    assert new_h.data_ptr() == h2.data_ptr() and x.data_ptr() == d2.data_ptr()  # in place, as documented
    got, err = _errors(x, eager_x, norm32(summed))
    assert got <= 1.5 * err + 1e-3 and got < 0.05, (got, err)

    gate_up = torch.randn(rows, 2 * 768, generator=g).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    got, err = _errors(ops.silu_mul(gate_up), eager.silu_mul(gate_up), F.silu(gate) * up)
    assert got <= 1.5 * err + 1e-3 and got < 0.05, (got, err)


@pytest.mark.parametrize("rows", [1, 3, 70])
def test_rope_rotates_q_and_k_where_they_sit_in_qkv_and_leaves_v(rows: int) -> None:
    ops, eager, rope = _regions()
    heads, d = 12 + 3, 64  # q and k heads rotated; v's 3 heads follow them in the row
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 3) * d, generator=g).bfloat16()
    positions = torch.randint(0, 4096, (rows,), generator=g)
    cos, sin = rope.tables(positions, torch.float32)
    want = apply_rope(qkv[:, : heads * d].float().view(rows, heads, d), cos, sin)
    mine = qkv.clone()
    got = ops.rope(mine, heads, ops.tables(rope, positions, torch.bfloat16))
    eager_out = eager.rope(qkv, heads, eager.tables(rope, positions, torch.bfloat16))
    assert got.shape == (rows, heads, d) and got.data_ptr() == mine.data_ptr()  # in place, in qkv's rows
    assert torch.equal(mine[:, heads * d :], qkv[:, heads * d :])  # v untouched
    err_ops, err_eager = _errors(got, eager_out, want)
    assert err_ops <= 1.5 * err_eager + 1e-3 and err_ops < 0.05, (err_ops, err_eager)
    wrong = ops.rope(qkv.clone(), heads, ops.tables(rope, positions + 1, torch.bfloat16))  # the positions matter
    assert (wrong.float() - want).abs().max().item() > 10 * err_ops


def test_a_forward_through_the_ops_stays_as_close_to_fp32_as_the_eager_forward() -> None:
    model = _llama()
    ops = LlamaForward.from_hf(model, dtype=torch.bfloat16)
    eager = LlamaForward(ops.weights, ops.rope, small=eager_regions(EPS))
    fp32 = LlamaForward.from_hf(model, dtype=torch.float32)
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    logits: dict[str, list[torch.Tensor]] = {}
    for name, fwd in (("fp32", fp32), ("eager", eager), ("ops", ops)):
        kv = KVStorage(fwd.kv_spec(), num_blocks=8, block_size=BLOCK)
        out = [fwd(plan_step([Chunk(prompt, start=0, slots=torch.arange(40))], block_size=BLOCK), kv).float()]
        prefix, own = SharedPrefix(0, 32), [kv.slots([4 + r]) for r in range(3)]
        for step in range(8):
            chunks = [Chunk([7 + r + step], start=32 + step, slots=own[r][: step + 1], prefix=prefix) for r in range(3)]
            out.append(fwd(plan_step(chunks, block_size=BLOCK), kv).float())
        logits[name] = out
    err = {arm: max((a - b).abs().max().item() for a, b in zip(logits[arm], logits["fp32"], strict=True))
           for arm in ("eager", "ops")}
    assert err["ops"] <= 1.5 * err["eager"] + 0.05, err
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(logits["ops"], logits["fp32"], strict=True))
    assert agree >= 22, agree  # of 25 rows


def test_rows_given_to_a_forward_are_not_written_by_the_in_place_ops() -> None:
    """A layer-split module starts at a layer from the base's hidden state: the regions write into
    the residual stream, never into the caller's rows."""
    fwd = LlamaForward.from_hf(_llama(), dtype=torch.bfloat16)
    kv = KVStorage(fwd.kv_spec(), num_blocks=4, block_size=BLOCK)
    hidden = torch.randn(3, 384).bfloat16()
    before = hidden.clone()
    plan = plan_step([Chunk([1, 2, 3], start=0, slots=torch.arange(3))], block_size=BLOCK)
    assert isinstance(fwd.regions(3), VllmRegions)
    fwd(plan, kv, first_layer=1, hidden=hidden)
    assert torch.equal(hidden, before)


def test_prefill_sized_steps_take_the_fused_kernels_once_loaded() -> None:
    fwd = LlamaForward.from_hf(_llama(), dtype=torch.bfloat16)
    fwd.fused.kernels = eager_kernels(EPS)  # as if built: the traced regions are the eager math
    assert isinstance(fwd.regions(FUSED_MIN_ROWS), TorchRegions)
    assert isinstance(fwd.regions(FUSED_MIN_ROWS - 1), VllmRegions)


@pytest.mark.timeout(300)
def test_the_benchmark_runs_both_ways_and_writes_its_figures(tmp_path: Path) -> None:
    """benchmarks/engine_elementwise.py, cut short: every workload, both arms compared."""
    out = tmp_path / "elementwise.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_elementwise.py"
    proc = subprocess.run([sys.executable, str(script), "--context", "64", "--rows", "2", "--steps", "2",
                           "--prefill", "80", "--reps", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["forward"]) == {"shared 2", "prefill 80"}
    for row in res["forward"].values():
        assert row["ms_per_step"]["torch"] > 0 and row["ms_per_step"]["vllm"] > 0 and row["max_logit_diff"] < 2
