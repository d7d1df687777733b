"""The engine on SmolLM2-135M: decode throughput, bf16-vs-fp32 agreement, and the headline —
N agents (different LoRA modules) on one shared context, shared prefill vs private prefill.

Both arms batch their decodes (continuous batching in one engine); they differ only in whether
the base-computed prefix is shared across modules (``EngineConfig.share_prefill``). Beside each
measured speed-up stands the prediction (N·P + D) / (P + D) of docs/design.md §7, from P (one prefill
of the shared context) and D (the N agents' own turns and batched decode, context cached),
measured in the same run.

    python benchmarks/engine_sharing.py [--dtype bfloat16] [--reps 3] [--json results/engine_sharing.json]
    python benchmarks/engine_sharing.py --quick      # a smoke run: small sizes, one rep
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from server.engine.build import load_engine
from server.engine.core import EngineConfig, EngineCore
from server.engine.numerics import dtype_name, resolve_dtype, set_threads
from server.engine.sampling import SamplingParams
from server.kv.family import family_digest
from server.models.loader import default_model_dir
from server.modules.manifest import LoraSpec, Manifest, ModuleKind
from server.prompt import Prompt, chat_prompt

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_loras(model_dir: Path, n: int, family: str, out: Path) -> dict[str, Path]:
    """``n`` random LoRA modules (rank 8, non-zero) with manifests naming ``family``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = {}
    for i in range(n):
        torch.manual_seed(100 + i)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS)),
        )
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01)
        d = out / f"agent{i}"
        model.save_pretrained(d)
        Manifest(name=f"agent{i}", kind=ModuleKind.LORA, family=family,
                 lora=LoraSpec(8, 16.0, TARGETS)).write(d)
        dirs[f"agent{i}"] = d
    return dirs


def run(core: EngineCore, requests: list[tuple[str, str, Prompt, SamplingParams]]) -> float:
    """Submit all requests together; wall seconds until every one finished."""
    t0 = time.perf_counter()
    for rid, module, prompt, params in requests:
        core.add_request(rid, module, prompt, params)
    while core.has_work:
        core.step()
    return time.perf_counter() - t0


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def agent_prompts(context: list[int], n_agents: int, vocab: int) -> list[Prompt]:
    out = []
    for i in range(n_agents):
        turn = random_tokens(24, 1000 + i, vocab)
        ids = tuple(context + turn)
        out.append(Prompt(ids, len(context), len(context), len(ids)))
    return out


def headline(base: EngineCore, *, n_agents: int, ctx: int, out_tokens: int, reps: int, vocab: int) -> dict:
    greedy = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    cfg = dict(kv_cache_bytes=base.config.kv_cache_bytes, max_step_tokens=base.config.max_step_tokens)
    shared_t, private_t, p_t, d_t = [], [], [], []
    for rep in range(reps):
        context = random_tokens(ctx, rep, vocab)  # a fresh context per rep: no cache carry-over
        prompts = agent_prompts(context, n_agents, vocab)
        reqs = [(f"a{i}", f"agent{i}", p, greedy) for i, p in enumerate(prompts)]
        for arm in ("shared", "private") if rep % 2 == 0 else ("private", "shared"):
            core = base.with_config(EngineConfig(share_prefill=arm == "shared", **cfg))
            (shared_t if arm == "shared" else private_t).append(run(core, reqs))
        # P: one prefill of the context alone; D: the agents' turns + batched decode, context cached
        core = base.with_config(EngineConfig(**cfg))
        t0 = time.perf_counter()
        core.add_context("ctx", context, ttl=600)
        while core.has_work:
            core.step()
        p_t.append(time.perf_counter() - t0)
        d_t.append(run(core, reqs))
    P, D = statistics.median(p_t), statistics.median(d_t)
    S, Pr = statistics.median(shared_t), statistics.median(private_t)
    predicted = (n_agents * P + D) / (P + D)
    return {"agents": n_agents, "context": ctx, "out_tokens": out_tokens, "P_s": P, "D_s": D,
            "shared_s": S, "private_s": Pr, "measured_speedup": Pr / S, "predicted_speedup": predicted,
            "measured_over_predicted": (Pr / S) / predicted, "shared_runs": shared_t, "private_runs": private_t}


def decode_rates(base: EngineCore, batches: list[int], *, ctx: int, steps: int, vocab: int) -> dict[int, float]:
    rates = {}
    for b in batches:
        core = base.with_config(EngineConfig(kv_cache_bytes=base.config.kv_cache_bytes))
        context = random_tokens(ctx, 7, vocab)
        prompts = agent_prompts(context, b, vocab)
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        for i, p in enumerate(prompts):
            core.add_request(f"d{i}", "base", p, params)
        while any(s.num_generated == 0 for s in core.running + list(core.waiting)):
            core.step()  # prefills and first tokens
        t0, n0 = time.perf_counter(), core.stats.decode_tokens
        while core.has_work:
            core.step()
        rates[b] = (core.stats.decode_tokens - n0) / (time.perf_counter() - t0)
    return rates


TEXT = Path(__file__).resolve().parents[1] / "examples" / "data" / "incident-report.md"


def agreement(bf16: EngineCore, fp32: EngineCore, *, prompts: int, tokens: int, vocab: int) -> dict:
    """Greedy tokens of bf16 vs fp32 on the same prompts: matching prefix length per prompt.

    Prompts are chat turns over 128-token windows of real text (the demo's incident report),
    asking to continue; random-token prompts would have near-tied distributions everywhere."""
    tok = bf16.tokenizer
    words = tok.encode(TEXT.read_text(), add_special_tokens=False)
    step = max(1, (len(words) - 128) // prompts)
    same = []
    for i in range(prompts):
        window = tok.decode(words[i * step : i * step + 128])
        p = chat_prompt(tok, [{"role": "user", "content": window}],
                        [{"role": "user", "content": "Summarise the passage above."}])
        outs = []
        for core in (bf16, fp32):
            c = core.with_config(EngineConfig(kv_cache_bytes=core.config.kv_cache_bytes))
            c.add_request("g", "base", p, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
            toks = []
            while c.has_work:
                toks += [e.token_id for e in c.step() if e.token_id is not None]
            outs.append(toks)
        n = next((k for k, (a, b) in enumerate(zip(*outs, strict=False)) if a != b), tokens)
        same.append(n)
    return {"prompts": prompts, "tokens": tokens, "identical_prompts": sum(n == tokens for n in same),
            "mean_matching_prefix": statistics.mean(same), "matching_prefix": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--agreement-only", action="store_true", help="only the bf16-vs-fp32 agreement")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    set_threads(args.threads)
    dt = resolve_dtype(args.dtype)
    model_dir = default_model_dir()
    family = family_digest(model_dir, kv_dtype=dtype_name(dt))
    cases = [(3, 2048, 64), (5, 2048, 64), (3, 4096, 16), (5, 4096, 16)]
    batches, agree_n = [1, 4, 8, 16], 20
    if args.quick:
        cases, batches, agree_n, args.reps = [(3, 512, 8)], [1, 4], 2, 1
    with tempfile.TemporaryDirectory() as tmp:
        modules = make_loras(model_dir, max(n for n, _, _ in cases), family, Path(tmp))
        cfg = EngineConfig(kv_cache_bytes=3 << 30, max_step_tokens=512)
        base = load_engine(model_dir, modules=modules, dtype=dt, config=cfg)
        vocab = base.forward.weights.shape.vocab_size
        result: dict = {"dtype": dtype_name(dt), "threads": torch.get_num_threads(), "headline": []}
        print(f"SmolLM2-135M, {dtype_name(dt)}, {torch.get_num_threads()} threads")
        if args.agreement_only:
            cases, batches = [], []
        rates = decode_rates(base, batches, ctx=512, steps=16 if args.quick else 32, vocab=vocab)
        result["decode_tok_s"] = rates
        if rates:
            print("decode tok/s: " + ", ".join(f"batch {b}: {r:.1f}" for b, r in rates.items()))
        if cases:
            print(f"{'agents':>6} {'context':>7} {'out':>4} {'P s':>6} {'D s':>6} {'shared s':>9} "
                  f"{'private s':>9} {'speed-up':>8} {'predicted':>9} {'meas/pred':>9}")
        for n, ctx, out in cases:
            h = headline(base, n_agents=n, ctx=ctx, out_tokens=out, reps=args.reps, vocab=vocab)
            result["headline"].append(h)
            print(f"{n:>6} {ctx:>7} {out:>4} {h['P_s']:>6.2f} {h['D_s']:>6.2f} {h['shared_s']:>9.2f} "
                  f"{h['private_s']:>9.2f} {h['measured_speedup']:>7.2f}x {h['predicted_speedup']:>8.2f}x "
                  f"{h['measured_over_predicted']:>8.0%}")
        if not args.skip_agreement and dt != torch.float32:
            fp32 = load_engine(model_dir, dtype="float32", config=cfg)
            result["agreement"] = agreement(base, fp32, prompts=agree_n, tokens=64, vocab=vocab)
            a = result["agreement"]
            print(f"bf16 vs fp32 greedy, {a['prompts']} real-text prompts x {a['tokens']} tokens: "
                  f"{a['identical_prompts']} identical, mean matching prefix {a['mean_matching_prefix']:.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
