"""Decode steps over long histories of their own: gathered into a padded batch, or read as views.

R requests, each with a history of ``--context`` tokens and no shared prefix (a single-turn chat
whose long user message is its own turn, or a raw prompt), decode ``--steps`` forced tokens in
the cascade (torch's kernels; vLLM's are not used here). The arms alternate in one process:
``views`` (each request's contiguous history as a view, the default from 256 slots on) and
``gathered`` (the padded gather and mask, as every history was read before). bf16, the default
model. Not a test: the figures depend on the machine.

    python benchmarks/decode_history.py --threads 2 --json results/decode_history.json
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from unittest import mock

import torch

from benchmarks.pairs import side_by_side, summary, write_json
from server.engine import batch
from server.engine.batch import Chunk, plan_step
from server.engine.forward import LlamaForward
from server.kv.storage import KVStorage
from server.models.loader import default_model_dir, load_model

BLOCK = 16


def workload(fwd: LlamaForward, rows: int, context: int, steps: int, views: bool) -> Callable[[], list[torch.Tensor]]:
    """``rows`` requests, each prefilled with its own ``context`` tokens, then their decode steps."""
    per = -(-(context + steps) // BLOCK)
    kv = KVStorage(fwd.kv_spec(), num_blocks=rows * per, block_size=BLOCK)
    gen = torch.Generator().manual_seed(0)
    slots = [kv.slots(list(range(r * per, (r + 1) * per))) for r in range(rows)]
    for r in range(rows):
        ids = torch.randint(100, 40000, (context,), generator=gen)
        fwd(plan_step([Chunk(ids, start=0, slots=slots[r][:context])], block_size=BLOCK), kv)
    forced = torch.randint(100, 40000, (steps, rows), generator=gen)
    limit = batch.VIEW_MIN_SLOTS if views else 1 << 62
    with mock.patch.object(batch, "VIEW_MIN_SLOTS", limit):
        plans = [plan_step([Chunk(forced[s, r : r + 1], start=context + s, slots=slots[r][: context + s + 1])
                            for r in range(rows)], block_size=BLOCK) for s in range(steps)]
    assert all((p.decode is not None and p.decode.spans is not None) == views for p in plans)
    return lambda: [fwd(p, kv) for p in plans]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3, 16])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=6, help="alternating pairs per request count")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fwd = LlamaForward.from_hf(load_model(default_model_dir()).model, dtype=torch.bfloat16)
    results: dict[str, object] = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                                  "torch": torch.__version__, "context": args.context, "runs": {}}
    with torch.inference_mode():
        for r in args.rows:
            arms = {"gathered": workload(fwd, r, args.context, args.steps, False),
                    "views": workload(fwd, r, args.context, args.steps, True)}
            row = side_by_side(arms, args.reps, args.steps)
            results["runs"][r] = row  # type: ignore[index]
            print(summary(f"{r:2} requests over {args.context} tokens each", row), flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
