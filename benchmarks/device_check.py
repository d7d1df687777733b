"""The GPU check's figures (``scripts/device-check``, docs/gpu.md): the embedded engine on one
device, each figure beside transformers on the same device and beside the hardware's limit.

For each model shape (``server/engine/synthetic.py``: the default model's, a 1B-class and an
8B-class Llama, random bf16 weights built on the device):

* prefill tok/s of one fresh context (2,048 and 8,192 tokens) — beside transformers' forward
  over the same tokens, and the bf16 peak (2 · linear params + attention FLOPs per token); a
  context longer than the engine's prefill step also in one step (what chunking costs there);
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
import logging
import platform
import statistics
import time
import traceback
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

WARMUP = 4
"""Decode steps run before the timed ones."""

FULL = dict(shapes=list(SHAPES), prefill=[2048, 8192], batches=[1, 16, 64], ctx=2048, out=64, agents=[3, 5],
            reps=3, decode_tokens=32, agreement_prompts=8)
QUICK = dict(shapes=["tiny"], prefill=[64, 128], batches=[1, 4], ctx=96, out=6, agents=[3], reps=1,
             decode_tokens=4, agreement_prompts=2, step_tokens=64)  # steps of 64: the 128-token prefill is chunked


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


def engine_prefill(core: EngineCore, n: int, reps: int, vocab: int, device: torch.device,
                   chunk: int | None = None) -> float:
    """tok/s of one fresh context of ``n`` tokens; ``chunk``: the engine's prefill step size
    (``max_prefill_step_tokens``) for this figure, else the engine's own."""
    config = core.config if chunk is None else EngineConfig(**{**_cfg(core.config), "max_prefill_step_tokens": chunk})
    rates = []
    for rep in range(reps + 1):  # the first is a warm-up
        fresh = core.with_config(config)
        s = timed(device, lambda c=fresh, ctx=tokens(n, 100 + rep, vocab): prefill(c, ctx))
        if rep:
            rates.append(n / s)
    return statistics.median(rates)


def engine_decode(core: EngineCore, batch: int, ctx: int, steps: int, vocab: int, device: torch.device,
                  graphs: str = "auto") -> tuple[float, dict[str, Any]]:
    """Rows/s of decode steps: ``batch`` requests on one pinned context, after their first token
    and ``WARMUP`` more (a CUDA graph is captured and checked on its first steps), and the
    decode graphs' counters. ``graphs``: the engine's ``decode_graphs`` mode."""
    c = core.with_config(EngineConfig(**{**_cfg(core.config), "decode_graphs": graphs}))
    context = tokens(ctx, 7, vocab)
    c.add_context("ctx", context, ttl=600)
    drain(c)
    params = SamplingParams(temperature=0, max_tokens=steps + WARMUP + 2, ignore_eos=True)
    for i in range(batch):
        turn = tokens(16, 1000 + i, vocab)
        ids = tuple(context + turn)
        c.add_request(f"r{i}", "base", Prompt(ids, ctx, ctx, len(ids)), params)
    while c.waiting or any(s.phase is not Phase.DECODE for s in c.running):  # the turns' prefill, first tokens
        c.step()
    for _ in range(WARMUP):
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
    g = c.runner.graphs
    return rate, {"graphs": g.mode if g is not None else "none", "captures": g.captures if g else 0,
                  "replays": g.replays if g else 0}


def headline(core: EngineCore, n_agents: int, ctx: int, out: int, reps: int, vocab: int,
             device: torch.device, graphs: str = "auto") -> dict[str, Any]:
    greedy = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    arms: dict[str, list[float]] = {"shared": [], "private": [], "P": [], "D": []}
    for rep in range(reps):
        context = tokens(ctx, 500 + rep, vocab)  # fresh every rep: no cache carries over
        reqs = []
        for i in range(n_agents):
            ids = tuple(context + tokens(24, 900 + i, vocab))
            reqs.append((f"a{i}", f"agent{i}", Prompt(ids, ctx, ctx, len(ids))))
        for arm in ("shared", "private") if rep % 2 == 0 else ("private", "shared"):
            c = core.with_config(EngineConfig(**{**_cfg(core.config), "share_prefill": arm == "shared",
                                                 "decode_graphs": graphs}))
            arms[arm].append(timed(device, lambda c=c, r=reqs: serve(c, r, greedy)))
        c = core.with_config(EngineConfig(**{**_cfg(core.config), "decode_graphs": graphs}))
        arms["P"].append(timed(device, lambda c=c, ctx=context: prefill(c, ctx)))
        arms["D"].append(timed(device, lambda c=c, r=reqs: serve(c, r, greedy)))
    med = {k: statistics.median(v) for k, v in arms.items()}
    predicted = (n_agents * med["P"] + med["D"]) / (med["P"] + med["D"])
    measured = med["private"] / med["shared"]
    return {"agents": n_agents, "graphs": graphs, "ctx": ctx, "out_tokens": out, "shared_s": med["shared"], "private_s": med["private"],
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
    def best(n: int, reps: int) -> float:  # the fastest of reps: noise on a busy host only adds time
        return min(timed(device, lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw))
                   for _ in range(reps))

    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        for attempt in range(3):  # when the timer cannot tell them apart: twice the steps, best of 3
            reps = 1 if attempt == 0 else 3
            one, many = best(1, reps), best(steps + 1, reps)
            if many > one:
                return batch * steps / (many - one)
            steps *= 2
    return float("nan")  # no figure rather than a wild one


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
                              "bf16_flops": flops}, "tests_rc": args.tests_rc, "shapes": {}, "skipped": [],
                              "errors": {}}

    class Events(logging.Handler):  # the engine's warnings (graphs turned off, kernels refused) with their why
        def emit(self, record: logging.LogRecord) -> None:
            entry = {"message": record.getMessage(), **{k: str(getattr(record, k)) for k in
                     ("event", "why", "kind", "kernel") if hasattr(record, k)}}
            result["engine_warnings"].append(entry)
            print(f"engine warning: {entry}", flush=True)

    result["engine_warnings"] = []
    engine_log = logging.getLogger("agentshare.engine")
    engine_log.addHandler(Events(logging.WARNING))
    engine_log.propagate = False

    def left() -> float:
        return args.budget - (time.perf_counter() - t_start)

    def save() -> None:  # after every part: a run stopped at its limit still leaves its figures
        result["seconds"] = time.perf_counter() - t_start
        result["attention_kernels"] = {"/".join(map(str, k)): v for k, v in KERNELS.items()}
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1, default=str))

    def part(key: str, fn: Callable[[], Any]) -> Any:
        """Run one part; a failure is recorded with its traceback and the run goes on."""
        try:
            return fn()
        except Exception as e:  # every failure is a finding of the check
            result["errors"][key] = traceback.format_exc()
            print(f"{key}: FAILED {type(e).__name__}: {e}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return None
        finally:
            save()

    shape = shape_params("tiny" if args.quick else "smollm2-135m")

    def agree() -> None:  # first: it is short, and the shapes' figures may use the budget up
        result["bf16_agreement"] = agreement(shape, plan["agreement_prompts"], plan["ctx"], plan["decode_tokens"],
                                             device)
        print(f"bf16 agreement: {result['bf16_agreement']}", flush=True)

    part("bf16_agreement", agree)
    def one_shape(sn: str) -> None:
        p = shape_params(sn)
        nums = model_numbers(p)
        vocab = p["vocab_size"]
        out: dict[str, Any] = {"numbers": nums}
        result["shapes"][sn] = out
        t0 = time.perf_counter()

        def build() -> tuple[torch.nn.Module, EngineCore]:
            model = random_hf_model(p, dtype=torch.bfloat16, device=device, seed=0)
            steps = {"max_step_tokens": plan["step_tokens"], "max_prefill_step_tokens": plan["step_tokens"]} \
                if "step_tokens" in plan else {}
            config = EngineConfig(kv_cache_bytes=(8 << 30) if device.type == "cuda" else 256 << 20,
                                  max_running=max(plan["batches"]) + 8, **steps)
            return model, random_engine(p, loras=max(plan["agents"]), dtype=torch.bfloat16, device=device,
                                        model=model, config=config)

        built = part(f"{sn}/build", build)
        if built is None:
            return
        model, core = built
        out["build_s"] = time.perf_counter() - t0
        print(f"[{sn}] built in {out['build_s']:.1f} s on {name}", flush=True)
        own = 16 + WARMUP + plan["decode_tokens"]  # each decode row's own tokens at the end

        def pre(n: int) -> None:
            ours = engine_prefill(core, n, plan["reps"], vocab, device)
            theirs = hf_prefill(model, n, plan["reps"], vocab, device)
            out[f"prefill_{n}"] = beside(f"[{sn}] prefill {n}", ours, theirs, prefill_limit(nums, n, flops))
            if n > core.config.max_prefill_step_tokens:  # the same context in one step: what chunking costs here
                whole = engine_prefill(core, n, plan["reps"], vocab, device, chunk=n)
                out[f"prefill_{n}_one_step"] = beside(f"[{sn}] prefill {n} in one step", whole, theirs,
                                                      prefill_limit(nums, n, flops))

        def dec(b: int) -> None:
            ours, graphs = engine_decode(core, b, plan["ctx"], plan["decode_tokens"], vocab, device)
            theirs = hf_decode(model, b, plan["ctx"], plan["decode_tokens"], vocab, device)
            limit = decode_limit(nums, b, plan["ctx"], bandwidth, own)
            out[f"decode_{b}"] = beside(f"[{sn}] decode batch {b} (graphs {graphs['graphs']}, {graphs['captures']} "
                                        f"captured, {graphs['replays']} replays)", ours, theirs, limit) | graphs
            if b == 1:  # the same steps without graphs: what the launches cost
                eager, counters = engine_decode(core, b, plan["ctx"], plan["decode_tokens"], vocab, device,
                                                graphs="off")
                out["decode_1_eager"] = beside(f"[{sn}] decode batch 1, graphs off", eager, theirs, limit) | counters

        def head(n_agents: int, graphs: str = "auto") -> None:
            h = headline(core, n_agents, plan["ctx"], plan["out"], plan["reps"], vocab, device, graphs=graphs)
            out[f"headline_{n_agents}" + ("" if graphs == "auto" else "_eager")] = h
            print(f"[{sn}] {n_agents} agents, graphs {graphs}: shared {h['shared_s']:.3f} s, private "
                  f"{h['private_s']:.3f} s, {h['speedup']:.2f}x (predicted {h['predicted']:.2f}x, "
                  f"{h['of_predicted']:.0%})", flush=True)

        for n in plan["prefill"]:
            if n + 1 <= p["max_position_embeddings"] and left() >= 20:  # a held context keeps one token's room
                part(f"{sn}/prefill_{n}", lambda n=n: pre(n))
        for b in plan["batches"]:
            if left() >= 20:
                part(f"{sn}/decode_{b}", lambda b=b: dec(b))
            else:
                result["skipped"].append(f"{sn}/decode_{b}")
        for n_agents in plan["agents"]:
            if left() >= 30:
                part(f"{sn}/headline_{n_agents}", lambda n=n_agents: head(n))
            else:
                result["skipped"].append(f"{sn}/headline_{n_agents}")
        if sn == plan["shapes"][0] and left() > 60:  # both arms without graphs: prefill sharing alone
            part(f"{sn}/headline_eager", lambda: head(min(plan["agents"]), graphs="off"))

    for shape_name in plan["shapes"]:
        if left() < 30:
            result["skipped"].append(shape_name)
            continue
        one_shape(shape_name)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save()
    print(f"done in {result['seconds']:.0f} s; skipped: {result['skipped'] or 'nothing'}; "
          f"failed: {list(result['errors']) or 'nothing'}")
    if result["errors"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
