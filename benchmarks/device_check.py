"""The GPU check's figures (``scripts/device-check``, docs/gpu.md): the embedded engine on one
device, each figure beside transformers on the same device and beside the hardware's limit.

For each model shape (``server/engine/synthetic.py``: the default model's, a 1B-class and an
8B-class Llama, random bf16 weights built on the device):

* prefill tok/s of one fresh context (2,048 and 8,192 tokens) — beside transformers' forward
  over the same tokens, and the bf16 peak (2 · linear params + attention FLOPs per token);
* decode tok/s at batch 1, 16 and 64, every request on one 2,048-token shared context with a
  turn of its own — beside transformers' ``generate`` (the context repeated per row, as it
  must), and the HBM limit (weights once per step, the context's KV once, each row's own KV);
* the headline: 3 and 5 agents with different LoRA modules on one fresh 2,048-token context,
  64 greedy tokens each, shared prefill vs private prefills, beside the prediction
  (N·P + D) / (P + D) from P (one prefill) and D (the agents on the cached context);
* bf16 agreement: the share of teacher-forced positions whose greedy token equals fp32's, on
  the default model's shape.

    python benchmarks/device_check.py --json device_check.json     # a CUDA machine: ~6 min on one H200
    python benchmarks/device_check.py --quick --device cpu          # the script itself, in seconds

Parts that would overrun ``--budget`` seconds are skipped and listed as such in the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from server.engine.attention import KERNELS
from server.engine.core import EngineConfig, EngineCore
from server.engine.cuda import device_name
from server.engine.device import resolve_device
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, Phase
from server.engine.synthetic import SHAPES, random_engine, random_hf_model, tiny_shape
from server.prompt import Prompt

# (HBM bytes/s, dense bf16 FLOP/s) from the vendors' data sheets, by a word of the device's name
LIMITS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12),
          "L40S": (0.864e12, 362e12), "A10": (0.6e12, 125e12)}

FULL = dict(shapes=list(SHAPES), prefill=[2048, 8192], batches=[1, 16, 64], ctx=2048, out=64, agents=[3, 5],
            reps=3, decode_tokens=32, agreement_prompts=8)
QUICK = dict(shapes=["tiny"], prefill=[64, 128], batches=[1, 4], ctx=96, out=6, agents=[3], reps=1,
             decode_tokens=4, agreement_prompts=2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(10, vocab - 10, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drain(core: EngineCore) -> None:
    while core.has_work:
        for e in core.step():
            if e.finish_reason is FinishReason.ERROR:
                raise RuntimeError(f"request {e.request_id} failed: {e.error}")


def shape_params(name: str) -> dict[str, Any]:
    return tiny_shape(num_hidden_layers=4, hidden_size=128, intermediate_size=256) if name == "tiny" else SHAPES[name]


def model_numbers(p: dict[str, Any]) -> dict[str, float]:
    """Parameters of the linears (without the embedding) and the lm_head, and KV bytes a token."""
    h, inter, layers = p["hidden_size"], p["intermediate_size"], p["num_hidden_layers"]
    hd = p.get("head_dim") or h // p["num_attention_heads"]
    q, kv = p["num_attention_heads"] * hd, p["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return {"linear_params": layers * per_layer, "lm_head_params": h * p["vocab_size"],
            "kv_bytes_per_token": 2 * layers * kv * 2, "layers": layers, "q_size": q}


def prefill_limit(nums: dict[str, float], n: int, flops: float | None) -> float | None:
    """tok/s at the bf16 peak: 2 FLOPs per linear parameter, causal attention (QK and PV)."""
    if flops is None:
        return None
    per_token = 2 * nums["linear_params"] + 2 * nums["layers"] * nums["q_size"] * n  # average context n/2, x2 matmuls
    return flops / per_token


def decode_limit(nums: dict[str, float], batch: int, ctx: int, bandwidth: float | None, own: int) -> float | None:
    """tok/s at the HBM bandwidth: per step the weights once (bf16), the shared context's KV once
    and each row's own KV."""
    if bandwidth is None:
        return None
    step_bytes = 2 * (nums["linear_params"] + nums["lm_head_params"]) + nums["kv_bytes_per_token"] * (ctx + batch * own)
    return batch * bandwidth / step_bytes


# ---- the engine --------------------------------------------------------------------------------


def prefill(core: EngineCore, context: list[int]) -> None:
    core.add_context("ctx", context, ttl=600)
    drain(core)


def serve(core: EngineCore, requests: list[tuple[str, str, Prompt]], params: SamplingParams) -> None:
    for rid, module, prompt in requests:
        core.add_request(rid, module, prompt, params)
    drain(core)


def engine_prefill(core: EngineCore, n: int, reps: int, vocab: int, device: torch.device) -> float:
    rates = []
    for rep in range(reps + 1):  # the first is a warm-up
        fresh = core.with_config(core.config)
        s = timed(device, lambda c=fresh, ctx=tokens(n, 100 + rep, vocab): prefill(c, ctx))
        if rep:
            rates.append(n / s)
    return statistics.median(rates)


def engine_decode(core: EngineCore, batch: int, ctx: int, steps: int, vocab: int, device: torch.device) -> float:
    """Rows/s of decode steps: ``batch`` requests on one pinned context, after their first token."""
    c = core.with_config(core.config)
    context = tokens(ctx, 7, vocab)
    c.add_context("ctx", context, ttl=600)
    drain(c)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        turn = tokens(16, 1000 + i, vocab)
        ids = tuple(context + turn)
        c.add_request(f"r{i}", "base", Prompt(ids, ctx, ctx, len(ids)), params)
    while c.waiting or any(s.phase is not Phase.DECODE for s in c.running):  # the turns' prefill, first tokens
        c.step()
    sync(device)
    t0 = time.perf_counter()
    done = 0
    while c.has_work and done < steps:
        c.step()
        done += 1
    sync(device)
    rate = batch * done / (time.perf_counter() - t0)
    drain(c)
    return rate


def headline(core: EngineCore, n_agents: int, ctx: int, out: int, reps: int, vocab: int,
             device: torch.device) -> dict[str, Any]:
    greedy = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    arms: dict[str, list[float]] = {"shared": [], "private": [], "P": [], "D": []}
    for rep in range(reps):
        context = tokens(ctx, 500 + rep, vocab)  # fresh every rep: no cache carries over
        reqs = []
        for i in range(n_agents):
            ids = tuple(context + tokens(24, 900 + i, vocab))
            reqs.append((f"a{i}", f"agent{i}", Prompt(ids, ctx, ctx, len(ids))))
        for arm in ("shared", "private") if rep % 2 == 0 else ("private", "shared"):
            c = core.with_config(EngineConfig(**{**_cfg(core.config), "share_prefill": arm == "shared"}))
            arms[arm].append(timed(device, lambda c=c, r=reqs: serve(c, r, greedy)))
        c = core.with_config(core.config)
        arms["P"].append(timed(device, lambda c=c, ctx=context: prefill(c, ctx)))
        arms["D"].append(timed(device, lambda c=c, r=reqs: serve(c, r, greedy)))
    med = {k: statistics.median(v) for k, v in arms.items()}
    predicted = (n_agents * med["P"] + med["D"]) / (med["P"] + med["D"])
    measured = med["private"] / med["shared"]
    return {"agents": n_agents, "ctx": ctx, "out_tokens": out, "shared_s": med["shared"], "private_s": med["private"],
            "P_s": med["P"], "D_s": med["D"], "speedup": measured, "predicted": predicted,
            "of_predicted": measured / predicted, "runs": arms}


def _cfg(config: EngineConfig) -> dict[str, Any]:
    return {f: getattr(config, f) for f in ("block_size", "kv_cache_bytes", "max_step_tokens",
                                            "max_prefill_step_tokens", "max_running")}


# ---- transformers on the same device -----------------------------------------------------------


def hf_prefill(model: torch.nn.Module, n: int, reps: int, vocab: int, device: torch.device) -> float:
    rates = []
    for rep in range(reps + 1):
        ids = torch.tensor([tokens(n, 100 + rep, vocab)], device=device)
        with torch.no_grad():
            s = timed(device, lambda ids=ids: model(ids, use_cache=True, logits_to_keep=1))
        if rep:
            rates.append(n / s)
    return statistics.median(rates)


def hf_decode(model: torch.nn.Module, batch: int, ctx: int, steps: int, vocab: int, device: torch.device) -> float:
    """Rows/s of ``generate``'s decode steps (the time of ``steps + 1`` new tokens less that of 1)."""
    context = tokens(ctx, 7, vocab)
    ids = torch.tensor([context + tokens(16, 1000 + i, vocab) for i in range(batch)], device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        one = timed(device, lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw))
        many = timed(device, lambda: model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **kw))
    return batch * steps / max(many - one, 1e-9)


# ---- bf16 against fp32 -------------------------------------------------------------------------


def agreement(shape: dict[str, Any], prompts: int, ctx: int, out: int, device: torch.device) -> dict[str, Any]:
    """Teacher-forced: fp32's greedy tokens forced through bf16; the share of positions where
    bf16's own greedy choice is the same, and the largest |logit difference|."""
    rows: dict[str, dict[str, list[torch.Tensor]]] = {"fp32": {}, "bf16": {}}
    forced: dict[str, tuple[int, ...]] = {}
    vocab = shape["vocab_size"]
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        model = random_hf_model(shape, dtype=torch.float32, device=device, seed=3)
        core = random_engine(shape, dtype=dt, device=device, model=model,
                             config=EngineConfig(kv_cache_bytes=512 << 20))
        core.logits_hook = lambda rid, row, name=name: rows[name].setdefault(rid, []).append(row.float().clone())
        for i in range(prompts):
            ids = tuple(tokens(ctx, 40 + i, vocab))
            params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True,
                                    forced_tokens=forced.get(f"p{i}", ()))
            core.add_request(f"p{i}", "base", Prompt(ids, ctx, ctx, ctx), params)
        drain(core)
        if name == "fp32":
            forced = {rid: tuple(int(r.argmax()) for r in rs) for rid, rs in rows["fp32"].items()}
        del core, model
    same = total = 0
    worst = 0.0
    for rid, ref in rows["fp32"].items():
        for a, b in zip(ref, rows["bf16"][rid], strict=True):
            same += int(a.argmax() == b.argmax())
            total += 1
            worst = max(worst, float((a - b).abs().max()))
    return {"positions": total, "same_greedy": same, "share": same / total, "max_abs_logit_diff": worst}


# ---- the run -----------------------------------------------------------------------------------


def beside(what: str, ours: float, theirs: float, limit: float | None) -> dict[str, float | None]:
    """One figure (tok/s) beside transformers' and the limit's; printed, and returned for the JSON."""
    print(f"{what}: {ours:,.1f} tok/s (transformers {theirs:,.1f}, limit {limit or float('nan'):,.0f})", flush=True)
    return {"engine_tok_s": ours, "transformers_tok_s": theirs, "limit_tok_s": limit,
            "vs_transformers": ours / theirs, "of_limit": ours / limit if limit else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--shapes", default=None, help="comma-separated shapes (default: all three)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: check the script, not the device")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; parts past it are skipped")
    ap.add_argument("--tests-rc", type=int, default=None, help="exit status of the cuda tests (recorded)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    plan = dict(QUICK if args.quick else FULL)
    if args.shapes:
        plan["shapes"] = args.shapes.split(",")
    device = resolve_device(args.device)
    t_start = time.perf_counter()
    name = device_name(device)
    bandwidth, flops = next((v for k, v in LIMITS.items() if k in name), (None, None))
    result: dict[str, Any] = {"device": str(device), "device_name": name, "torch": torch.__version__,
                              "host": platform.node(), "plan": plan, "limits": {"hbm_bytes_s": bandwidth,
                              "bf16_flops": flops}, "tests_rc": args.tests_rc, "shapes": {}, "skipped": []}

    def left() -> float:
        return args.budget - (time.perf_counter() - t_start)

    for shape_name in plan["shapes"]:
        if left() < 30:
            result["skipped"].append(shape_name)
            continue
        p = shape_params(shape_name)
        nums = model_numbers(p)
        vocab = p["vocab_size"]
        out: dict[str, Any] = {"numbers": nums}
        result["shapes"][shape_name] = out
        t0 = time.perf_counter()
        model = random_hf_model(p, dtype=torch.bfloat16, device=device, seed=0)
        config = EngineConfig(kv_cache_bytes=(8 << 30) if device.type == "cuda" else 256 << 20,
                              max_running=max(plan["batches"]) + 8)
        core = random_engine(p, loras=max(plan["agents"]), dtype=torch.bfloat16, device=device, model=model,
                             config=config)
        out["build_s"] = time.perf_counter() - t0
        print(f"[{shape_name}] built in {out['build_s']:.1f} s on {name}", flush=True)
        for n in plan["prefill"]:
            if n > p["max_position_embeddings"] or left() < 20:
                continue
            ours = engine_prefill(core, n, plan["reps"], vocab, device)
            theirs = hf_prefill(model, n, plan["reps"], vocab, device)
            out[f"prefill_{n}"] = beside(f"[{shape_name}] prefill {n}", ours, theirs, prefill_limit(nums, n, flops))
        for b in plan["batches"]:
            if left() < 20:
                result["skipped"].append(f"{shape_name}/decode_{b}")
                continue
            ours = engine_decode(core, b, plan["ctx"], plan["decode_tokens"], vocab, device)
            theirs = hf_decode(model, b, plan["ctx"], plan["decode_tokens"], vocab, device)
            out[f"decode_{b}"] = beside(f"[{shape_name}] decode batch {b}", ours, theirs,
                                        decode_limit(nums, b, plan["ctx"], bandwidth, 16 + plan["decode_tokens"]))
        for n_agents in plan["agents"]:
            if left() < 30:
                result["skipped"].append(f"{shape_name}/headline_{n_agents}")
                continue
            h = headline(core, n_agents, plan["ctx"], plan["out"], plan["reps"], vocab, device)
            out[f"headline_{n_agents}"] = h
            print(f"[{shape_name}] {n_agents} agents: shared {h['shared_s']:.3f} s, private {h['private_s']:.3f} s, "
                  f"{h['speedup']:.2f}x (predicted {h['predicted']:.2f}x, {h['of_predicted']:.0%})", flush=True)
        del core, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if left() > 30:
        shape = shape_params("tiny" if args.quick else "smollm2-135m")
        result["bf16_agreement"] = agreement(shape, plan["agreement_prompts"], plan["ctx"], plan["decode_tokens"],
                                             device)
        print(f"bf16 agreement: {result['bf16_agreement']}", flush=True)
    else:
        result["skipped"].append("bf16_agreement")
    result["attention_kernels"] = {"/".join(map(str, k)): v for k, v in KERNELS.items()}
    result["seconds"] = time.perf_counter() - t_start
    print(f"done in {result['seconds']:.0f} s; skipped: {result['skipped'] or 'nothing'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
