"""The cost of constrained decoding per decode step, on the default model: the same batch of
requests decoded unconstrained and under a JSON Schema, side by side in one run.

Per batch size (``--batch``, default 1 and 8), each arm submits that many requests (one chat
prompt each, sampled at temperature 1 with fixed seeds, EOS ignored) and times every engine step
after the last prefill while the whole batch is still running. The constrained arm's requests
carry a JSON Schema (an object holding an array of at least 200 short strings) that no run of
``--tokens`` tokens can complete, so the grammar stays open for the whole run; its steps include filling each request's mask on the mask thread
(overlapping the forward), the one masking op and each matcher consuming its token.

    python benchmarks/constrained_decoding.py [--tokens 48] [--batch 1 8] [--threads 2] [--repeats 3] [--json out.json]

Prints median ms per decode step of each arm and the ratio constrained / unconstrained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from server.engine.build import load_engine
from server.engine.constraints import Constraint
from server.engine.core import EngineConfig, EngineCore
from server.engine.sampling import SamplingParams
from server.models.loader import default_model_dir
from server.prompt import chat_prompt

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "minItems": 200,
                                                    "items": {"type": "string", "maxLength": 24}}},
          "required": ["notes"], "additionalProperties": False}


def decode_steps(core: EngineCore, batch: int, tokens: int, constraint: Constraint | None) -> list[float]:
    """Seconds of each step after the prefills, while all ``batch`` requests run."""
    core = core.with_config(EngineConfig(kv_cache_bytes=64 << 20))
    for i in range(batch):
        turn = [{"role": "user", "content": f"Describe item {i} in JSON."}]
        prompt = chat_prompt(core.tokenizer, [], turn)  # type: ignore[arg-type]  # a transformers tokenizer
        core.add_request(f"r{i}", "base", prompt, SamplingParams(max_tokens=tokens, seed=i, ignore_eos=True,
                                                                 constraint=constraint))
    times: list[float] = []
    while core.has_work:
        decoding = len(core.running) == batch and all(s.num_generated > 0 for s in core.running)
        started = time.perf_counter()
        core.step()
        if decoding and len(core.running) == batch:
            times.append(time.perf_counter() - started)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each arm, alternated (steps pooled)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    core = load_engine(default_model_dir(), threads=args.threads)
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    decode_steps(core, 1, 4, constraint)  # warm up: the grammar backend (built once) and the forward
    results = []
    for batch in args.batch:
        free: list[float] = []
        held: list[float] = []
        for _ in range(args.repeats):  # alternated, so that a noisy neighbour hits both arms
            free += decode_steps(core, batch, args.tokens, None)
            held += decode_steps(core, batch, args.tokens, constraint)
        row = {"batch": batch, "steps": [len(free), len(held)],
               "unconstrained_ms": 1e3 * statistics.median(free), "constrained_ms": 1e3 * statistics.median(held)}
        row["ratio"] = row["constrained_ms"] / row["unconstrained_ms"]
        results.append(row)
        print(f"batch {batch}: unconstrained {row['unconstrained_ms']:.2f} ms/step, constrained "
              f"{row['constrained_ms']:.2f} ms/step, ratio {row['ratio']:.3f} ({len(free)}/{len(held)} steps)")
    if args.json:
        args.json.write_text(json.dumps({"tokens": args.tokens, "threads": args.threads, "repeats": args.repeats,
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
