"""Decode attention of a few requests through vLLM's CPU kernel (server/engine/vllm_attention.py),
where the vllm extra is installed: the attention of each request's whole sequence, as close to
fp32 as the cascade it replaces, in a forward and through the engine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from server.engine import cascade, vllm_attention
from server.engine.batch import Chunk, SharedPrefix, plan_step
from server.engine.build import load_engine
from server.engine.cascade import cascade_attention
from server.engine.core import EngineConfig
from server.engine.forward import LlamaForward
from server.engine.sampling import SamplingParams
from server.kv.storage import KVStorage
from server.prompt import text_prompt

pytestmark = pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="vLLM's CPU ops need AVX512-BF16")

BLOCK = 16


def test_it_is_on_where_the_vllm_package_is() -> None:
    assert vllm_attention.status() == "on", vllm_attention.status()
    assert vllm_attention.serves(torch.bfloat16, "cpu", 64)
    assert not vllm_attention.serves(torch.float32, "cpu", 64)  # fp32 (the oracle tests) keeps the cascade
    assert not vllm_attention.serves(torch.bfloat16, "cpu", 16)  # the kernels refuse heads of 16 at the first call


def _decode_step(rows: int, hkv: int = 3, g: int = 3, d: int = 64, prefix_len: int = 300):
    """KV storage [Hkv, slots, D] with a shared prefix in blocks 0.. and each request's own slots
    scattered after it; one query row per request."""
    torch.manual_seed(rows)
    slots = 1024
    k_cache, v_cache = torch.randn(hkv, slots, d), torch.randn(hkv, slots, d)
    prefix = SharedPrefix(0, prefix_len)
    own = [torch.tensor([512 + 37 * r + 3 * i for i in range(5 + 4 * r)]) for r in range(rows)]
    chunks = [Chunk([1], start=prefix_len + len(o) - 1, slots=o, prefix=prefix) for o in own]
    q = torch.randn(rows, hkv, g, d)
    want = []
    for r in range(rows):
        keys = torch.cat([torch.arange(prefix_len), own[r]])  # the request's whole sequence
        k, v = k_cache[:, keys].double(), v_cache[:, keys].double()  # [Hkv, L, D]
        weights = torch.softmax(q[r].double() @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)  # [Hkv, G, L]
        want.append((weights @ v).float())
    return q, k_cache, v_cache, chunks, torch.stack(want)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_each_request_attends_its_prefix_and_its_own_slots_as_the_cascade_does(rows: int, threads: int) -> None:
    q, k_cache, v_cache, chunks, want = _decode_step(rows)
    bf = {name: t.bfloat16() for name, t in (("q", q), ("k", k_cache), ("v", v_cache))}
    plan = plan_step(chunks, block_size=BLOCK, whole_sequences=vllm_attention.MAX_ROWS)
    assert plan.sequences is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # 1 thread: every sequence whole; 2 threads, 1 request: keys split in two
    try:
        got = vllm_attention.decode(bf["q"], bf["k"], bf["v"], plan.sequences).float()
    finally:
        torch.set_num_threads(before)
    no_kernel = plan_step(chunks, block_size=BLOCK)
    unused = torch.empty(0)  # a step of decodes reads its new K/V from the cache, where they were written
    cascaded = cascade_attention(bf["q"], unused, unused, bf["k"], bf["v"], no_kernel).float()
    assert got.shape == want.shape
    err, cascade_err = (got - want).abs().max().item(), (cascaded - want).abs().max().item()
    assert err <= 2e-2, err  # bf16 rounding, not another key set (that errs by ~1)
    assert err <= 2 * cascade_err + 4e-3, (err, cascade_err)


@pytest.mark.parametrize("case", ["one prompt", "a chunk after its history", "a chunk beside a decode"])
def test_each_request_of_a_step_without_a_shared_prefix_attends_its_sequence_causally(case: str) -> None:
    hkv, g, d = 3, 3, 64
    torch.manual_seed(len(case))
    k_cache, v_cache = torch.randn(hkv, 1024, d), torch.randn(hkv, 1024, d)
    chunks = {
        "one prompt": [Chunk(list(range(300)), start=0, slots=torch.arange(300))],
        "a chunk after its history": [Chunk(list(range(64)), start=100, slots=torch.arange(164))],
        "a chunk beside a decode": [Chunk(list(range(50)), start=0, slots=torch.arange(400, 450)),
                                    Chunk([1], start=30, slots=torch.arange(600, 631))],
    }[case]
    plan = plan_step(chunks, block_size=BLOCK, whole_sequences=vllm_attention.MAX_ROWS)
    assert plan.sequences is not None and not plan.sequences.decode_only
    t = plan.num_tokens
    q = torch.randn(t, hkv, g, d)
    want = []
    for c in chunks:  # row i of a chunk sees the sequence up to its own token
        for i in range(c.num_new):
            keys = c.slots[: c.slots.numel() - c.num_new + i + 1]
            k, v = k_cache[:, keys].double(), v_cache[:, keys].double()
            weights = torch.softmax(q[len(want)].double() @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
            want.append((weights @ v).float())
    bf = {name: x.bfloat16() for name, x in (("q", q), ("k", k_cache), ("v", v_cache))}
    k_new = bf["k"].index_select(1, plan.write_slots).transpose(0, 1)  # [T, Hkv, D], as the forward hands them
    v_new = bf["v"].index_select(1, plan.write_slots).transpose(0, 1)
    got = vllm_attention.attend(bf["q"], k_new, v_new, bf["k"], bf["v"], plan.sequences).float()
    cascaded = cascade_attention(bf["q"], k_new, v_new, bf["k"], bf["v"], plan_step(chunks, block_size=BLOCK)).float()
    err = (got - torch.stack(want)).abs().max().item()
    cascade_err = (cascaded - torch.stack(want)).abs().max().item()
    assert err <= 2e-2, err
    assert err <= 2 * cascade_err + 4e-3, (err, cascade_err)


def _tiny_bf16_and_fp32() -> tuple[LlamaForward, LlamaForward]:
    cfg = LlamaConfig(vocab_size=512, hidden_size=384, intermediate_size=768, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    return (LlamaForward.from_hf(model, dtype=torch.bfloat16), LlamaForward.from_hf(model, dtype=torch.float32))


def test_a_forward_of_few_decodes_through_the_kernel_stays_as_close_to_fp32_as_the_cascade() -> None:
    bf16, fp32 = _tiny_bf16_and_fp32()
    prompt = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(1))
    logits: dict[str, list[torch.Tensor]] = {}
    for name, fwd, whole in (("fp32", fp32, 0), ("cascade", bf16, 0), ("kernel", bf16, vllm_attention.MAX_ROWS)):
        kv = KVStorage(fwd.kv_spec(), num_blocks=32, block_size=BLOCK)
        fwd(plan_step([Chunk(prompt, start=0, slots=torch.arange(200))], block_size=BLOCK), kv)
        prefix, own = SharedPrefix(0, 192), [kv.slots([20 + r]) for r in range(3)]  # 192 shared, then each its own
        out = []
        for step in range(8):
            chunks = [Chunk([7 + r + step], start=192 + step, slots=own[r][: step + 1], prefix=prefix)
                      for r in range(3)]
            plan = plan_step(chunks, block_size=BLOCK, whole_sequences=whole)
            assert (plan.sequences is not None) == (whole > 0)
            out.append(fwd(plan, kv).float())
        logits[name] = out
    err = {arm: max((a - b).abs().max().item() for a, b in zip(logits[arm], logits["fp32"], strict=True))
           for arm in ("cascade", "kernel")}
    assert err["kernel"] <= 1.5 * err["cascade"] + 0.05, err
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(logits["kernel"], logits["fp32"], strict=True))
    assert agree >= 20, agree  # of 24 rows


def test_the_decode_kernel_writes_the_steps_keys_and_values_where_the_forward_would(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hkv, g, d = 3, 3, 64
    torch.manual_seed(3)
    k_cache, v_cache = torch.randn(hkv, 1024, d).bfloat16(), torch.randn(hkv, 1024, d).bfloat16()
    prefix = SharedPrefix(0, 300)
    own = [torch.tensor([500 + 40 * r + i for i in range(10)]) for r in range(3)]
    plan = plan_step([Chunk([1], start=309, slots=o, prefix=prefix) for o in own], block_size=BLOCK,
                     whole_sequences=vllm_attention.MAX_ROWS)
    assert plan.attention_writes_kv and plan.sequences is not None
    q = torch.randn(3, hkv, g, d).bfloat16()
    qkv = torch.randn(3, (hkv * g + 2 * hkv) * d).bfloat16()  # k and v where the forward has them: views into qkv
    k_new = qkv[:, hkv * g * d : (hkv * g + hkv) * d].view(3, hkv, d)
    v_new = qkv[:, (hkv * g + hkv) * d :].view(3, hkv, d)
    copied_k, copied_v = k_cache.clone(), v_cache.clone()  # what the forward's copy would leave
    copied_k.index_copy_(1, plan.write_slots, k_new.transpose(0, 1))
    copied_v.index_copy_(1, plan.write_slots, v_new.transpose(0, 1))
    want = vllm_attention.decode(q, copied_k, copied_v, plan.sequences)
    got = vllm_attention.attend(q, k_new, v_new, k_cache, v_cache, plan.sequences)
    assert torch.equal(k_cache, copied_k) and torch.equal(v_cache, copied_v)  # written, and nothing else touched
    assert torch.equal(got, want)
    # in a forward: every layer's K/V of a decode step are in the pool after it, as the kernel was handed them
    bf16, _ = _tiny_bf16_and_fp32()
    kv = KVStorage(bf16.kv_spec(), num_blocks=8, block_size=BLOCK)
    bf16(plan_step([Chunk(torch.arange(40), start=0, slots=torch.arange(40))], block_size=BLOCK), kv)
    handed = []
    real = vllm_attention.decode
    monkeypatch.setattr(vllm_attention, "decode", lambda *a, **k: handed.append((a[5].clone(), a[6].clone())) or real(*a, **k))
    slots = [kv.slots([4 + r])[:1] for r in range(3)]
    step = plan_step([Chunk([9 + r], start=32, slots=slots[r], prefix=SharedPrefix(0, 32)) for r in range(3)],
                     block_size=BLOCK, whole_sequences=vllm_attention.MAX_ROWS)
    bf16(step, kv)
    assert len(handed) == bf16.weights.shape.num_layers
    for layer, (k, v) in enumerate(handed):
        assert torch.equal(kv.k[layer][:, step.write_slots], k.transpose(0, 1))
        assert torch.equal(kv.v[layer][:, step.write_slots], v.transpose(0, 1))


@pytest.mark.timeout(300)
def test_the_engine_decodes_a_few_requests_through_the_kernel(base_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = vllm_attention.decode
    monkeypatch.setattr(cascade.vllm_attention, "decode", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    core = load_engine(base_dir, dtype="bfloat16", config=EngineConfig(kv_cache_bytes=64 << 20))
    assert core.runner.whole_sequences == vllm_attention.MAX_ROWS
    context = "You review Python code for a small team. " * 8
    for i, ask in enumerate(("Summarise it.", "Name a risk.", "Suggest a test.")):
        prompt = text_prompt(core.tokenizer, context + ask)
        core.add_request(f"r{i}", "base", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    done: dict[str, int] = {}
    while core.has_work:
        for e in core.step():
            if e.token_id is not None:
                done[e.request_id] = done.get(e.request_id, 0) + 1
    assert done == {"r0": 12, "r1": 12, "r2": 12}
    assert calls and set(calls) <= {1, 2, 3}  # every decode step of the three, 30 layers each
    assert len(calls) >= 30 * 10


@pytest.mark.timeout(300)
def test_the_benchmark_runs_both_ways_and_writes_its_figures(tmp_path: Path) -> None:
    """benchmarks/engine_attention.py, cut short: both parts, every workload, both arms compared."""
    import json
    import subprocess
    import sys

    out = tmp_path / "attention.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_attention.py"
    proc = subprocess.run([sys.executable, str(script), "--context", "64", "--layer-rows", "1", "3", "--calls", "5",
                           "--rows", "2", "--private-rows", "2", "--steps", "2", "--reps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["layer"]) == {"1", "3"} and set(res["forward"]) == {"prefill", "shared 2", "private 2"}
    for row in res["layer"].values():
        assert row["cascade_us"] > 0 and row["kernel_us"] > 0 and row["max_abs_diff"] < 0.05
    for fwd in res["forward"].values():
        assert fwd["ms_per_step"]["cascade"] > 0 and fwd["ms_per_step"]["kernel"] > 0 and fwd["max_logit_diff"] < 2
