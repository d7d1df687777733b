"""The embedded engine on a device, against transformers on the same device (docs/gpu.md).

Every test runs on the CPU and, where torch sees one, on a CUDA device (those cases are marked
``cuda``; ``scripts/device-check`` runs them). The file needs no fixture of the repository's
conftest files and no model package: it runs with ``--noconftest`` on a machine that has torch
and transformers only (the GPU machine). Models are tiny random Llamas built on the device;
decode modules are random LoRA deltas and a perturbed full copy, and the oracle folds each
module into a transformers model of its own.

The oracle of docs/design.md §2: the base computes the positions before the invocation point,
the module continues from the base's KV.
"""

from __future__ import annotations

import copy

import pytest
import torch

from server.engine import attention
from server.engine.config import EngineConfig
from server.engine.core import EngineCore
from server.engine.cuda import to_host
from server.engine.forward import LlamaForward
from server.engine.modules import DecodeModule, base_module
from server.engine.sampling import SamplingParams
from server.engine.synthetic import IdDecoder, random_hf_model, random_lora, tiny_shape
from server.prompt import Prompt

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])]
FORCED = (11, 200, 37, 91, 5, 140)
ATOL = 2e-4
BLOCK = 16


def merged(hf: torch.nn.Module, deltas: dict) -> torch.nn.Module:
    """A transformers copy of ``hf`` with a LoRA module's deltas folded into its weights."""
    model = copy.deepcopy(hf)
    names = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o": ("self_attn", ("o_proj",)),
             "gate_up": ("mlp", ("gate_proj", "up_proj")), "down": ("mlp", ("down_proj",))}
    with torch.no_grad():
        for (layer, fused), updates in deltas.items():
            block, parts = names[fused]
            linears = [getattr(getattr(model.model.layers[layer], block), p) for p in parts]
            starts, col = [], 0
            for lin in linears:
                starts.append(col)
                col += lin.weight.shape[0]
            for u in updates:
                lin = linears[starts.index(u.col)]
                lin.weight += u.scale * (u.b.float() @ u.a.float()).to(lin.weight.dtype)
    return model


@pytest.fixture(scope="module", params=DEVICES)
def team(request):
    """A base, a LoRA module and a full module on one device, with their transformers twins."""
    device = torch.device(request.param)
    base = random_hf_model(tiny_shape(), dtype=torch.float32, device=device, seed=0)
    forward = LlamaForward.from_hf(base, dtype=torch.float32, device=device)
    deltas = random_lora(forward, rank=4, seed=1, std=0.1)
    full = copy.deepcopy(base)
    with torch.no_grad():
        g = torch.Generator(device="cpu").manual_seed(2)
        for p in full.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(device) * 0.02)
    modules = {"base": base_module("tiny"),
               "lora": DecodeModule("lora", "lora", "tiny-lora", True, weights=deltas),
               "full": DecodeModule("full", "full", "tiny-full", True,
                                    weights=LlamaForward.from_hf(full, device=device).weights)}
    twins = {"base": base, "lora": merged(base, deltas), "full": full}
    return device, forward, modules, twins


def engine(forward, modules) -> tuple[EngineCore, dict[str, list[torch.Tensor]]]:
    core = EngineCore(forward, IdDecoder(), family="tiny", modules=modules,
                      config=EngineConfig(kv_cache_bytes=8 << 20, block_size=BLOCK, max_step_tokens=48))
    rows: dict[str, list[torch.Tensor]] = {}
    core.logits_hook = lambda rid, row: rows.setdefault(rid, []).append(row.clone())
    return core, rows


def drain(core: EngineCore) -> dict[str, list]:
    events: dict[str, list] = {}
    while core.has_work:
        for e in core.step():
            events.setdefault(e.request_id, []).append(e)
    return events


def prompt(context: list[int], turn: list[int]) -> Prompt:
    ids = tuple(context + turn)
    return Prompt(ids, len(context), len(context), len(ids))


def oracle(twins, module: str, tokens: list[int], ip: int, n_rows: int, device) -> torch.Tensor:
    ids = torch.tensor([tokens], device=device)
    with torch.no_grad():
        cache = twins["base"](ids[:, :ip], use_cache=True).past_key_values
        out = twins[module](ids[:, ip:], past_key_values=cache, use_cache=True)
    return out.logits[0, -n_rows:].float().cpu()


@pytest.mark.parametrize("module", ["base", "lora", "full"])
def test_a_module_served_from_another_modules_prefill_equals_transformers_on_the_device(team, module):
    device, forward, modules, twins = team
    core, rows = engine(forward, modules)
    g = torch.Generator().manual_seed(7)
    context = torch.randint(3, 250, (70,), generator=g).tolist()  # 4 full blocks and a tail
    first = prompt(context, [9, 8, 7])
    core.add_request("first", "lora" if module != "lora" else "full", first,
                     SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    drain(core)
    p = prompt(context, [4, 5, 6, 7])
    params = SamplingParams(temperature=0, max_tokens=len(FORCED), forced_tokens=FORCED, ignore_eos=True)
    seq = core.add_request("second", module, p, params)
    events = drain(core)["second"]
    assert [e.token_id for e in events if e.token_id is not None] == list(FORCED)
    assert seq.cached_tokens == 64  # it read the other module's blocks of the context
    ip = len(p.token_ids) - 1 if module == "base" else p.invocation_point(modules[module].placement)
    want = oracle(twins, module, list(p.token_ids) + list(FORCED[:-1]), ip, len(FORCED), device)
    got = torch.stack(rows["second"]).float()
    assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()
    if device.type == "cuda":  # the device kernel served, after agreeing with the reference
        kinds = {k: v for k, v in attention.KERNELS.items() if k[:2] == ("cuda", "float32")}  # fp32: no flash
        assert kinds and set(kinds.values()) == {"efficient"}, kinds


def test_a_team_decoding_together_equals_each_agent_alone(team):
    """The cascade over a shared prefix with decode rows of three weight sets in one step."""
    _, forward, modules, _ = team
    context = torch.randint(3, 250, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = {}
    for name in modules:
        core, _ = engine(forward, modules)
        core.add_request(name, name, prompt(context, [1, 2, 3]), params)
        alone[name] = [e.token_id for e in drain(core)[name] if e.token_id is not None]
    core, _ = engine(forward, modules)
    for name in modules:
        core.add_request(name, name, prompt(context, [1, 2, 3]), params)
    together = {k: [e.token_id for e in v if e.token_id is not None] for k, v in drain(core).items()}
    assert together == alone


def test_decode_steps_from_graphs_equal_the_eager_ones(team):
    """On CUDA the decode steps are captured and replayed; on the CPU the same padded steps run
    eagerly. Greedy tokens equal, logits within the graphs' own first-replay tolerance."""
    device, forward, modules, _ = team
    context = torch.randint(3, 250, (50,), generator=torch.Generator().manual_seed(5)).tolist()
    out = {}
    for mode in ("off", "auto" if device.type == "cuda" else "padded"):
        core = EngineCore(forward, IdDecoder(), family="tiny", modules=modules,
                          config=EngineConfig(kv_cache_bytes=8 << 20, block_size=BLOCK, decode_graphs=mode))
        rows: dict[str, list[torch.Tensor]] = {}
        core.logits_hook = lambda rid, row, rows=rows: rows.setdefault(rid, []).append(row.float().clone())
        core.add_context("ctx", context, ttl=60)
        drain(core)
        # rows [lora, base, lora, base]; when r0 ends, [base, lora, base] stay in the bucket of
        # four with the same module set, each row now another's: a replay must read the new rows
        for i, name in enumerate(["lora", "base", "lora", "base"]):
            core.add_request(f"r{i}", name, prompt(context, [1 + i, 2]),
                             SamplingParams(temperature=0, max_tokens=(4, 12, 12, 12)[i], ignore_eos=True))
        tokens = {k: [e.token_id for e in v if e.token_id is not None] for k, v in drain(core).items()}
        out[mode] = (tokens, rows, core.runner.graphs)
    (want, want_rows, _), (got, got_rows, graphs) = out["off"], out[next(m for m in out if m != "off")]
    assert got == want
    for rid in want_rows:
        assert torch.allclose(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=ATOL)
    assert graphs is not None and graphs.replays > 0 and graphs.mode != "off"
    assert (graphs.captures > 0) == (device.type == "cuda")


def test_decode_steps_over_several_prefixes_from_graphs_equal_the_eager_ones(team):
    """Rows over two contexts and another tenant's copy of one: each prefix's rows are a mask
    in the graph, filled every step."""
    device, forward, modules, _ = team
    g = torch.Generator().manual_seed(6)
    contexts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (40, 56)]
    turns = [torch.randint(3, 250, (5,), generator=g).tolist() for _ in range(4)]
    out = {}
    for mode in ("off", "auto" if device.type == "cuda" else "padded"):
        core = EngineCore(forward, IdDecoder(), family="tiny", modules=modules,
                          config=EngineConfig(kv_cache_bytes=8 << 20, block_size=BLOCK, decode_graphs=mode))
        rows: dict[str, list[torch.Tensor]] = {}
        core.logits_hook = lambda rid, row, rows=rows: rows.setdefault(rid, []).append(row.float().clone())
        for i, ctx in enumerate(contexts):
            core.add_context(f"ctx{i}", ctx, ttl=60)
        core.add_context("other", contexts[0], ttl=60, salt="t2")
        drain(core)
        for i, (name, ctx, salt) in enumerate([("lora", 0, ""), ("base", 1, ""), ("base", 0, "t2"), ("lora", 1, "")]):
            core.add_request(f"r{i}", name, prompt(contexts[ctx], turns[i]),
                             SamplingParams(temperature=0, max_tokens=(4, 12, 9, 12)[i], ignore_eos=True), salt=salt)
        tokens = {k: [e.token_id for e in v if e.token_id is not None] for k, v in drain(core).items()}
        out[mode] = (tokens, rows, core.runner.graphs)
    (want, want_rows, _), (got, got_rows, graphs) = out["off"], out[next(m for m in out if m != "off")]
    assert got == want
    for rid in want_rows:
        assert torch.allclose(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=ATOL)
    assert graphs is not None and graphs.replays > 0 and graphs.mode != "off"
    assert max(len(key[2]) for key in graphs._graphs) == 3


def test_kv_leaves_the_device_through_the_host_copy_unchanged(team):
    device, forward, modules, _ = team
    core, _ = engine(forward, modules)
    core.add_request("r", "base", prompt(list(range(10, 60)), [1]), SamplingParams(max_tokens=1))
    drain(core)
    k, v = core.kv.k[1][:, :48], core.kv.v[1][:, :48]
    (hk, hv), wait = to_host(k, v)
    if wait is not None:
        wait()
    assert hk.device.type == "cpu" and (wait is None) == (device.type == "cpu")
    assert torch.equal(hk, k.cpu()) and torch.equal(hv, v.cpu()) and hk.abs().sum() > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_half_precision_prefill_attention_is_served_by_the_flash_kernel():
    """A prefill chunk (causal among itself, keys broadcast over query heads with stride 0) and
    its read of a history (no mask, query heads folded), laid out as ``cascade.py`` lays them:
    the flash kernel is chosen and agrees with the fp32 reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hkv, grp, n, hist, d = 2, 4, 300, 700, 64
    q = torch.randn(n, hkv, grp, d, device="cuda", generator=g, dtype=torch.bfloat16).permute(1, 2, 0, 3)
    k_new, v_new = (torch.randn(n, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    kc, vc = (t.permute(1, 0, 2).unsqueeze(1).expand(hkv, grp, n, d) for t in (k_new, v_new))
    kh, vh = (torch.randn(1, hkv, hist, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    folded = q.reshape(1, hkv, grp * n, d)
    for causal, (qq, k, v) in ((True, (q, kc, vc)), (False, (folded, kh, vh))):
        got = attention.partial_attention(qq, k, v, causal=causal)
        ref = attention.reference_partial(qq, k, v, causal=causal)
        assert attention.KERNELS[("cuda", "bfloat16", causal, False)] == "flash"
        assert (got.out.float() - ref.out.float()).abs().max() < 3e-2
        assert (got.lse - ref.lse).abs().max() < 1e-3
