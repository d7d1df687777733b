"""How much a bf16 answer served from a shared prefill differs from the same answer served cold,
and how both differ from fp32, on SmolLM2-135M-Instruct.

Each prompt is the canonical layout: a shared context (a 128-token window of a Python stdlib
source file: real text, stable for one Python version) and an agent's instruction. Two decode
modules are measured: the base, and a seeded random non-zero LoRA (rank 8 on every projection;
no trained module ships) whose manifest joins the family. Per prompt and module, arms:

    fp32   cold, in an fp32 engine: the reference; its greedy tokens R are what everyone is
           teacher-forced on
    cold   bf16, served in a tenant of its own (its own cache salt): the base computes the same
           prefix and nothing is reused
    shared bf16, the context prefilled first by another request (``add_context``, as the SDK's
           ``client.context`` does), then the request reads it from the pool

each measured **alone** (one request in the engine) and in a **batch of 3** modules stepping
together (the base, the LoRA and a second LoRA: each arm's three requests submitted at once).
Every arm is pinned to ``dtype=bfloat16`` (``auto`` is fp32 on hosts without native bf16).

Figures, per setting, module and pair of arms:

- top-1 agreement: teacher-forced on R for ``--tokens`` positions, the fraction of positions where
  both arms' argmax agree;
- first divergence of the greedy outputs (``--tokens`` if none). A greedy run follows R until its
  argmax first leaves it, so against fp32 it is read off the forced run (in the batch: with its
  batch mates forced on their references); between the two bf16 arms too, unless both leave R at
  the same position for the same token: then both arms are rerun greedily (the whole batch);
- the largest first-token logit difference: max over the vocabulary of |Δ logit| of the first
  generated position (raw logits, seen through the engine's ``logits_hook``).

    python benchmarks/bf16_agreement.py [--prompts 50] [--tokens 64] [--threads 2] [--json out.json]
    python benchmarks/bf16_agreement.py --json benchmarks/recorded/bf16_agreement.json --resume
    python benchmarks/bf16_agreement.py --fused ...   # bf16 with the fused elementwise kernels

The JSON keeps every prompt's raw traces (written after each prompt; ``--resume`` continues a
stopped run), so figures can be recomputed over any subset of prompts and any shorter length
(``summarize``): tests/benchmarks/test_bf16_agreement.py compares a short run with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import statistics
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from server.engine.build import load_engine
from server.engine.core import EngineConfig, EngineCore
from server.engine.elementwise import KernelSpec, build, load
from server.engine.numerics import set_threads
from server.engine.sampling import SamplingParams
from server.kv.family import family_digest
from server.modules.manifest import LoraSpec, Manifest, ModuleKind
from server.paths import cache_dir
from server.prompt import Prompt, chat_prompt

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = ("heapq.py", "textwrap.py", "calendar.py", "fractions.py", "contextlib.py", "statistics.py",
           "functools.py", "difflib.py")
INSTRUCTIONS = ("Summarise the passage above in two sentences.", "What does this code do?",
                "List the names it defines.", "Explain the first function to a beginner.",
                "What could go wrong here?", "Write one unit test for it.", "Which module is this from, and why?")
WINDOW = 128
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULES = ("base", "lora", "lora2")  # the batch; "lora2" is a companion, not reported
REPORTED = ("base", "lora")
SETTINGS = {"alone": (("base",), ("lora",)), "batch3": (MODULES,)}
PAIRS = ("shared~cold", "cold~fp32", "shared~fp32")
LORA_SEEDS = {"lora": 11, "lora2": 12}


# ---- inputs ---------------------------------------------------------------------------------

def prompts(tokenizer: Any, n: int) -> list[Prompt]:
    """Prompt ``i`` (independent of ``n``): window ``i // 8`` of source ``i % 8``, instruction ``i % 7``."""
    texts: dict[str, list[int]] = {}
    out = []
    for i in range(n):
        name = SOURCES[i % len(SOURCES)]
        if name not in texts:
            texts[name] = tokenizer.encode((STDLIB / name).read_text(), add_special_tokens=False)
        words = texts[name]
        start = (i // len(SOURCES)) * WINDOW
        if start + WINDOW > len(words):
            raise SystemExit(f"--prompts {n} is too many: {name} has only {len(words) // WINDOW} windows")
        window = tokenizer.decode(words[start : start + WINDOW])
        out.append(chat_prompt(tokenizer, [{"role": "user", "content": f"From {name}:\n\n{window}"}],
                               [{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)]}]))
    return out


def digest(prompt: Prompt) -> str:
    return hashlib.sha256(json.dumps(list(prompt.token_ids)).encode()).hexdigest()[:16]


def lora_dir(model_dir: Path, name: str, family: str, *, root: Path | None = None) -> Path:
    """A seeded random non-zero LoRA of ``model_dir`` (rank 8, every projection) whose manifest
    joins ``family``; built once (peft, a few seconds) and cached under the cache directory."""
    seed = LORA_SEEDS[name]
    target = (root or cache_dir() / "benchmarks") / f"bf16-{name}-s{seed}-{family[:16]}"
    if Manifest.read(target) is not None:
        return target
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS)))
    with torch.no_grad():  # peft zero-initialises B: make the adapter matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        Manifest(name=name, kind=ModuleKind.LORA, family=family, lora=LoraSpec(8, 16.0, TARGETS)).write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process built it first
            if Manifest.read(target) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def engines(model_dir: Path) -> dict[str, EngineCore]:
    """The bf16 and fp32 engines, each serving the base and both LoRAs in its own family."""
    out = {}
    for dtype in ("bfloat16", "float32"):
        family = family_digest(model_dir, kv_dtype=dtype)
        mods = {m: lora_dir(model_dir, m, family) for m in LORA_SEEDS}
        core = load_engine(model_dir, modules=mods, dtype=dtype)
        assert all(core.modules[m].shares_prefill for m in mods), [core.modules[m].reason for m in mods]
        out[dtype] = core
    return out


# ---- serving ----------------------------------------------------------------------------------

@dataclass
class Trace:
    tokens: list[int] = field(default_factory=list)  # emitted (forced or greedy)
    argmax: list[int] = field(default_factory=list)  # argmax of every row sampled from
    first: torch.Tensor | None = None  # float32 logits of the first generated position
    cached: int = 0  # prompt tokens read from the pool


def serve(core: EngineCore, prompt: Prompt, modules: Sequence[str], *, shared: bool, tag: str, tokens: int,
          forced: Mapping[str, Sequence[int]] | None = None) -> dict[str, Trace]:
    """Serve ``prompt`` to ``modules`` together (greedy, or teacher-forced on ``forced``).

    ``shared``: another request prefills the context first and every module reads it from the
    pool; otherwise each module runs in a tenant (cache salt) of its own and reuses nothing.
    """
    traces = {m: Trace() for m in modules}
    ids = {f"{tag}/{m}": m for m in modules}
    core.logits_hook = lambda rid, row: _observe(traces[ids[rid]], row) if rid in ids else None
    if shared:
        core.add_context(f"{tag}/ctx", prompt.token_ids[: prompt.context_len], ttl=3600, salt=tag)
        _drain(core, traces, ids)
    seqs = {}
    for rid, m in ids.items():
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                forced_tokens=tuple(forced[m][:tokens]) if forced else ())
        seqs[m] = core.add_request(rid, m, prompt, params, salt=tag if shared else rid)
    _drain(core, traces, ids)
    if shared:
        core.release_context(f"{tag}/ctx")
    bs = core.config.block_size
    for m, seq in seqs.items():
        traces[m].cached = seq.cached_tokens
        assert seq.cached_tokens >= (prompt.context_len // bs * bs if shared else 0), (tag, m, seq.cached_tokens)
        assert shared or seq.cached_tokens == 0, (tag, m, seq.cached_tokens)
        assert len(traces[m].tokens) == tokens, (tag, m, len(traces[m].tokens))
    return traces


def _observe(trace: Trace, row: torch.Tensor) -> None:
    if trace.first is None:
        trace.first = row.float().clone()
    trace.argmax.append(int(torch.argmax(row)))


def _drain(core: EngineCore, traces: dict[str, Trace], ids: dict[str, str]) -> None:
    while core.has_work:
        for e in core.step():
            if e.error:
                raise RuntimeError(e.error)
            if e.token_id is not None and e.request_id in ids:
                traces[ids[e.request_id]].tokens.append(e.token_id)


# ---- one prompt -------------------------------------------------------------------------------

def leaves(argmax: Sequence[int], ref: Sequence[int], tokens: int) -> int:
    """First position where a run forced on ``ref`` would pick another token (``tokens`` if none)."""
    return next((k for k in range(tokens) if argmax[k] != ref[k]), tokens)


def matching(a: Sequence[int], b: Sequence[int], tokens: int) -> int:
    return next((k for k in range(tokens) if a[k] != b[k]), tokens)


def ambiguous(shared: Sequence[int], cold: Sequence[int], ref: Sequence[int], tokens: int) -> bool:
    """Both greedy runs leave ``ref`` at the same position for the same token: where they part
    after that cannot be read off the forced runs."""
    k = leaves(shared, ref, tokens)
    return k < tokens and k == leaves(cold, ref, tokens) and shared[k] == cold[k]


def measure_prompt(cores: Mapping[str, EngineCore], prompt: Prompt, tokens: int,
                   *, kv_bytes: int = 64 << 20) -> dict:
    """Every arm, setting and figure of one prompt, as a JSON-ready record of raw traces.

    A fresh engine (empty pool) per prompt and dtype makes a prompt's record independent of
    the others, so a run over the first k prompts reproduces the first k records."""
    bf16, fp32 = (cores[d].with_config(EngineConfig(kv_cache_bytes=kv_bytes)) for d in ("bfloat16", "float32"))
    ref = {m: serve(fp32, prompt, [m], shared=False, tag=f"fp32/{m}", tokens=tokens)[m] for m in REPORTED}
    forced = {m: ref[m].tokens for m in REPORTED} | {"lora2": ref["base"].tokens}  # lora2: a companion
    settings: dict[str, dict] = {}
    for setting, groups in SETTINGS.items():
        rec: dict[str, dict] = {}
        for group in groups:
            tag = f"{setting}/{'+'.join(group)}"
            arms = {arm: serve(bf16, prompt, group, shared=arm == "shared", tag=f"{tag}/{arm}/forced",
                               tokens=tokens, forced=forced) for arm in ("shared", "cold")}
            reported = [m for m in group if m in REPORTED]
            greedy = None
            if any(ambiguous(arms["shared"][m].argmax, arms["cold"][m].argmax, forced[m], tokens) for m in reported):
                greedy = {arm: serve(bf16, prompt, group, shared=arm == "shared", tag=f"{tag}/{arm}/greedy",
                                     tokens=tokens) for arm in ("shared", "cold")}
            for m in reported:
                firsts = {"shared": arms["shared"][m].first, "cold": arms["cold"][m].first, "fp32": ref[m].first}
                rec[m] = {
                    "shared": arms["shared"][m].argmax, "cold": arms["cold"][m].argmax,
                    "greedy": {arm: g[m].tokens for arm, g in greedy.items()} if greedy else None,
                    "first_logit_diff": {p: _maxdiff(firsts, p) for p in PAIRS},
                    "cached": {arm: arms[arm][m].cached for arm in arms},
                }
        settings[setting] = rec
    return {"digest": digest(prompt), "prompt_tokens": len(prompt.token_ids), "context_tokens": prompt.context_len,
            "reference": {m: ref[m].tokens for m in REPORTED}, "settings": settings}


def _maxdiff(firsts: Mapping[str, torch.Tensor | None], pair: str) -> float:
    a, b = (firsts[x] for x in pair.split("~"))
    assert a is not None and b is not None
    return float((a - b).abs().max())


# ---- figures ----------------------------------------------------------------------------------

def pair_figures(rec: Mapping, ref: Sequence[int], pair: str, tokens: int) -> tuple[int, int, float]:
    """(top-1 agreements, first greedy divergence, first-token max |Δ logit|) of one prompt."""
    seqs = {"shared": rec["shared"], "cold": rec["cold"], "fp32": ref}
    a, b = (seqs[x] for x in pair.split("~"))
    agree = sum(x == y for x, y in zip(a[:tokens], b[:tokens], strict=True))
    if pair == "shared~cold":
        if ambiguous(a, b, ref, tokens):
            g = rec["greedy"]
            assert g is not None, "an ambiguous divergence without its greedy runs"
            div = matching(g["shared"], g["cold"], tokens)
        else:
            div = min(leaves(a, ref, tokens), leaves(b, ref, tokens))
    else:
        div = leaves(a, ref, tokens)
    return agree, div, rec["first_logit_diff"][pair]


def summarize(records: Iterable[Mapping], tokens: int) -> dict:
    """Figures per setting, module and pair over ``records``, for the first ``tokens`` positions."""
    records = list(records)
    out: dict[str, dict] = {}
    for setting in SETTINGS:
        for m in REPORTED:
            for pair in PAIRS:
                rows = [pair_figures(r["settings"][setting][m], r["reference"][m], pair, tokens) for r in records]
                agree, divs, diffs = zip(*rows, strict=True)
                out.setdefault(setting, {}).setdefault(m, {})[pair] = {
                    "top1_agreement": sum(agree) / (tokens * len(rows)),
                    "top1_disagreements": tokens * len(rows) - sum(agree),
                    "identical_greedy": sum(d == tokens for d in divs),
                    "mean_first_divergence": statistics.mean(divs),
                    "min_first_divergence": min(divs),
                    "max_first_logit_diff": max(diffs),
                    "median_first_logit_diff": statistics.median(diffs),
                }
    return out


LOGIT_STEP = 0.125  # one bf16 step at the scale of these logits (|logit| in [16, 32))


def regressions(got: Mapping, recorded: Mapping, *, positions: int, sigmas: float = 0.0) -> list[str]:
    """Each figure of ``got`` more than 2x worse than in ``recorded`` (both from ``summarize``
    over the same prompts and tokens): disagreements and logit differences twice as large (a
    recorded zero counts as one position, or one bf16 step), greedy outputs parting twice as early.
    Disagreements may exceed twice the recorded count by ``sigmas`` Poisson standard deviations
    (``sqrt(got + recorded)``): a recording from another CPU flips other positions."""
    worse = []
    for setting, mods in got.items():
        for m, pairs in mods.items():
            for pair, g in pairs.items():
                r, where = recorded[setting][m][pair], f"{setting} {m} {pair}"
                g_n, r_n = (1 - g["top1_agreement"]) * positions, (1 - r["top1_agreement"]) * positions
                if g_n - 2 * max(r_n, 1.0) > sigmas * math.sqrt(g_n + r_n) + 1e-9:
                    worse.append(f"{where}: top-1 agreement {g['top1_agreement']:.4f}, "
                                 f"recorded {r['top1_agreement']:.4f}")
                if g["mean_first_divergence"] < r["mean_first_divergence"] / 2:
                    worse.append(f"{where}: greedy outputs part at {g['mean_first_divergence']:.1f} on average, "
                                 f"recorded {r['mean_first_divergence']:.1f}")
                if g["max_first_logit_diff"] > 2 * max(r["max_first_logit_diff"], LOGIT_STEP):
                    worse.append(f"{where}: first-token |Δlogit| {g['max_first_logit_diff']:.3f}, "
                                 f"recorded {r['max_first_logit_diff']:.3f}")
    return worse


def sharing_worse_than_bf16(figures: Mapping, *, sigmas: float = 0.0) -> list[str]:
    """Where a shared request disagrees (top-1, teacher-forced) with the same request served cold
    more often than the cold bf16 request disagrees with fp32, by more than ``sigmas`` standard
    deviations of the difference of the two counts (as Poisson counts: sqrt(a + b)). 0: any
    excess counts (the full run); a small sample needs room for noise, since which positions
    bf16 flips differs between CPUs (kernels with or without AMX)."""
    out = []
    for setting, mods in figures.items():
        for m, f in mods.items():
            shared, cold = f["shared~cold"]["top1_disagreements"], f["cold~fp32"]["top1_disagreements"]
            if shared - cold > sigmas * math.sqrt(shared + cold):
                out.append(f"{setting} {m}: shared~cold {shared} disagreements, cold~fp32 {cold}")
    return out


def table(figures: Mapping, prompts: int, tokens: int) -> str:
    lines = [f"{'setting':7s} {'module':6s} {'pair':12s} {'top-1 agree':>12s} {'identical':>9s} "
             f"{'mean 1st div':>12s} {'max |Δlogit|':>12s} {'median':>7s}"]
    for setting, mods in figures.items():
        for m, pairs in mods.items():
            for pair, f in pairs.items():
                lines.append(f"{setting:7s} {m:6s} {pair:12s} {100 * f['top1_agreement']:11.2f}% "
                             f"{f['identical_greedy']:>4d}/{prompts:<4d} {f['mean_first_divergence']:12.1f} "
                             f"{f['max_first_logit_diff']:12.3f} {f['median_first_logit_diff']:7.3f}")
    return "\n".join(lines) + f"\n({prompts} prompts x {tokens} tokens; |Δlogit|: raw logits of the first token)"


def run(cores: Mapping[str, EngineCore], batch: Sequence[Prompt], tokens: int, *, done: Sequence[dict] = (),
        on_record: Callable[[list[dict]], None] | None = None, quiet: bool = False) -> list[dict]:
    """Records of ``batch`` (reusing ``done``, the records of its first prompts)."""
    records = list(done)
    for p, r in zip(batch, records, strict=False):
        if r["digest"] != digest(p):
            raise SystemExit(f"prompt {records.index(r)} changed since it was recorded: start afresh")
    for i in range(len(records), len(batch)):
        t = time.perf_counter()
        records.append(measure_prompt(cores, batch[i], tokens))
        if on_record:
            on_record(records)
        if not quiet:
            print(f"  prompt {i + 1}/{len(batch)}: {time.perf_counter() - t:.1f} s", flush=True)
    return records


def main(argv: Sequence[str] | None = None) -> None:
    from server.models.loader import default_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--resume", action="store_true", help="continue the run recorded in --json")
    ap.add_argument("--fused", action="store_true",
                    help="the bf16 engine with the fused elementwise kernels (built first if missing); fp32 stays eager")
    args = ap.parse_args(argv)
    if args.resume and not (args.json and args.json.is_file()):
        ap.error("--resume needs an existing --json file")
    set_threads(args.threads)
    started = time.perf_counter()
    model_dir = default_model_dir()
    cores = engines(model_dir)
    if args.fused:
        spec = KernelSpec.of(cores["bfloat16"].forward.weights)
        build(spec, progress=lambda line: print(f"fused kernels: {line}", flush=True))
        cores["bfloat16"].forward.fused.kernels = load(spec)
    batch = prompts(cores["bfloat16"].tokenizer, args.prompts)
    done: list = []
    elapsed = 0.0
    if args.resume:
        old = json.loads(args.json.read_text())
        if old["tokens"] != args.tokens:
            raise SystemExit(f"{args.json} was recorded with --tokens {old['tokens']}")
        done, elapsed = old["records"][: args.prompts], old.get("seconds", 0.0)
    print(f"SmolLM2-135M-Instruct, bf16 vs fp32, {len(batch)} prompts x {args.tokens} tokens, "
          f"{torch.get_num_threads()} thread(s), {len(done)} prompts already recorded", flush=True)

    def save(records: list) -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.json.with_suffix(".tmp")  # replaced whole: a reader never sees half a file
            tmp.write_text(json.dumps({
                "model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "reference_dtype": "float32",
                "tokens": args.tokens, "threads": torch.get_num_threads(), "window": WINDOW,
                "seconds": round(elapsed + time.perf_counter() - started, 1),
                "figures": summarize(records, args.tokens), "records": records}) + "\n")
            tmp.replace(args.json)

    records = run(cores, batch, args.tokens, done=done, on_record=save)
    save(records)
    print(table(summarize(records, args.tokens), len(records), args.tokens))
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
