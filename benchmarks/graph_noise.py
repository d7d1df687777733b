"""How far bf16 moves a decode step's logits: the padded step (what a CUDA graph captures,
``decode_graphs="padded"``) against the eager one, beside the same rows batched differently.
The figures behind ``graphs.replay_tolerance`` (docs/gpu.md).

A team of three random LoRA modules (rank 16, every projection) decodes six forced tokens over
one pinned 256-token context, three ways: eagerly, padded, and agent0 alone. Each figure is the
largest ``|difference|`` over its steps, relative to the reference row's largest ``|logit|``.

    python benchmarks/graph_noise.py --shape llama-1b                       # ~30 s on 2 cores
    python benchmarks/graph_noise.py --shape llama-8b --layers 8 --json noise.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from server.engine.config import EngineConfig
from server.engine.sampling import SamplingParams
from server.engine.synthetic import SHAPES, random_engine, random_hf_model, tiny_shape
from server.prompt import Prompt

CONTEXT = 256
FORCED = (11, 22, 33, 44, 55, 66)
AGENTS = ("agent0", "agent1", "agent2")


def team_logits(shape: dict[str, Any], model: torch.nn.Module, dtype: torch.dtype, graphs: str,
                agents: tuple[str, ...]) -> dict[str, list[torch.Tensor]]:
    """Each agent's rows of logits while the team decodes the forced tokens."""
    core = random_engine(shape, loras=len(AGENTS), dtype=dtype, device="cpu", model=model,
                         config=EngineConfig(kv_cache_bytes=256 << 20, decode_graphs=graphs))
    rows: dict[str, list[torch.Tensor]] = {}
    core.logits_hook = lambda rid, row: rows.setdefault(rid, []).append(row.float().clone())
    high = min(1000, shape["vocab_size"] - 10)
    context = torch.randint(10, high, (CONTEXT,), generator=torch.Generator().manual_seed(1)).tolist()
    core.add_context("ctx", context, ttl=60)
    while core.has_work:
        core.step()
    ids = tuple(context + [5, 6, 7])
    params = SamplingParams(temperature=0, max_tokens=len(FORCED), forced_tokens=FORCED, ignore_eos=True)
    for agent in agents:
        core.add_request(agent, agent, Prompt(ids, CONTEXT, CONTEXT, len(ids)), params)
    while core.has_work:
        core.step()
    return rows


def relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m", help=f"one of {', '.join(SHAPES)}, or tiny")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many layers (a big shape on a CPU)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = tiny_shape() if args.shape == "tiny" else dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    dtype = getattr(torch, args.dtype)
    model = random_hf_model(shape, dtype=dtype, device="cpu", seed=0)
    eager = team_logits(shape, model, dtype, "off", AGENTS)
    padded = team_logits(shape, model, dtype, "padded", AGENTS)
    alone = team_logits(shape, model, dtype, "off", AGENTS[:1])
    result = {"shape": args.shape, "layers": shape["num_hidden_layers"], "dtype": args.dtype,
              "padded_vs_eager": {a: relative(padded[a], eager[a]) for a in AGENTS},
              "alone_vs_batched": relative(alone[AGENTS[0]], eager[AGENTS[0]])}
    print(f"{args.shape} ({result['layers']} layers, {args.dtype}): padded vs eager up to "
          f"{max(result['padded_vs_eager'].values()):.2%}; agent0 alone vs batched {result['alone_vs_batched']:.2%} "
          "of the largest logit")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
