"""The torch engine's bf16 linears on oneDNN's inner product (torch) or matmul (the vllm
package's CPU ops, ``server/engine/vllm_matmul.py``), side by side in one process.

Both forwards hold the default model's weights, one per kernel. The arms alternate, A B A B, on
a 2,048-token prefill and on decode steps of 1, 3 and 16 rows over a shared 2,048-token prefix.
It prints medians per arm, and the median and range of the B / A ratios of each pair. The
logits of the two kernels are compared first. Needs the vllm extra (run it with
``.venv-vllm/bin/python``); not a test: the figures depend on the machine.

    .venv-vllm/bin/python benchmarks/engine_linears.py --threads 2 --json results/engine_linears.json
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from unittest import mock

import torch

from benchmarks.pairs import side_by_side, summary, write_json
from server.engine import vllm_matmul
from server.engine.batch import Chunk, SharedPrefix, plan_step
from server.engine.forward import LlamaForward
from server.kv.storage import KVStorage
from server.models.loader import default_model_dir, load_model

BLOCK = 16


def _prefill(fwd: LlamaForward, ids: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
    n = ids.numel()
    kv = KVStorage(fwd.kv_spec(), num_blocks=n // BLOCK + 1, block_size=BLOCK)
    plan = plan_step([Chunk(ids, start=0, slots=torch.arange(n))], block_size=BLOCK)
    return lambda: [fwd(plan, kv)]


def _decode(fwd: LlamaForward, ids: torch.Tensor, rows: int, steps: int) -> Callable[[], list[torch.Tensor]]:
    """``rows`` requests over the shared prefix ``ids``, each decoding ``steps`` forced tokens."""
    n = ids.numel()
    prefix_blocks, own_blocks = n // BLOCK + 1, -(-steps // BLOCK)
    kv = KVStorage(fwd.kv_spec(), num_blocks=prefix_blocks + rows * own_blocks, block_size=BLOCK)
    fwd(plan_step([Chunk(ids, start=0, slots=torch.arange(n))], block_size=BLOCK), kv)
    prefix = SharedPrefix(0, n)
    own = [kv.slots(list(range(prefix_blocks + r * own_blocks, prefix_blocks + (r + 1) * own_blocks)))
           for r in range(rows)]
    forced = torch.randint(100, 40000, (steps, rows), generator=torch.Generator().manual_seed(1))
    plans = [plan_step([Chunk(forced[s, r : r + 1], start=n + s, slots=own[r][: s + 1], prefix=prefix)
                        for r in range(rows)], block_size=BLOCK) for s in range(steps)]
    return lambda: [fwd(p, kv) for p in plans]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10, help="alternating pairs per workload")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3, 16])
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not vllm_matmul.available():
        raise SystemExit(f"vLLM's oneDNN matmul is not available: {vllm_matmul.status()}")
    model = load_model(default_model_dir()).model
    matmul = LlamaForward.from_hf(model, dtype=torch.bfloat16)
    with mock.patch.object(vllm_matmul, "available", lambda: False):
        inner = LlamaForward.from_hf(model, dtype=torch.bfloat16)
    assert (matmul.weights.layers[0].qkv.kernel, inner.weights.layers[0].qkv.kernel) == (
        "onednn-matmul", "onednn-inner-product")
    ids = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0))
    work: dict[str, tuple[int, dict[str, Callable[[], list[torch.Tensor]]]]] = {
        f"prefill {args.context}": (1, {k: _prefill(f, ids) for k, f in (("inner", inner), ("matmul", matmul))})}
    for r in args.rows:
        work[f"decode {r} rows"] = (args.steps, {k: _decode(f, ids, r, args.steps)
                                                 for k, f in (("inner", inner), ("matmul", matmul))})
    results: dict[str, object] = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                                  "torch": torch.__version__, "context": args.context, "runs": {}}
    with torch.inference_mode():
        for name, (per, arms) in work.items():
            row = side_by_side(arms, args.reps, per)
            results["runs"][name] = row  # type: ignore[index]
            print(summary(f"{name:16}", row), flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
