"""The engine's attention on the cascade (torch's flash kernel) or on vLLM's CPU kernels
(``server/engine/vllm_attention.py``), side by side in one process, bf16.

* **one layer's decode attention** over a shared prefix of ``--context`` tokens (the default
  model's heads: 3 KV heads of 3 query heads, D = 64): the cascade's prefix partial, the
  requests' own partial and their merge, against one call of the decode kernel over each
  request's whole sequence; medians of ``--calls`` calls per request count;
* **the engine's forward**, the default model, alternating, ``--reps`` pairs per workload, the
  logits of both arms compared: ``--steps`` decode steps of R requests over the shared prefix
  (``shared R``); the same over histories of ``--context`` tokens each with no prefix at all
  (``private R``: as a raw prompt without a context decodes); a prefill of ``--context`` tokens
  (``prefill``: the extend kernel).

Needs the vllm extra (run it with ``.venv-vllm/bin/python``); not a test: the figures depend on
the machine.

    .venv-vllm/bin/python benchmarks/engine_attention.py --threads 2 --json results/engine_attention.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.pairs import side_by_side, summary, write_json
from server.engine import vllm_attention
from server.engine.attention import merge_partials
from server.engine.batch import Chunk, SharedPrefix, plan_step
from server.engine.cascade import _decode_partial, _prefix_partial
from server.engine.forward import LlamaForward
from server.kv.storage import KVStorage
from server.models.loader import default_model_dir, load_model

BLOCK = 16
OWN = 40  # tokens of each request's own past the prefix, in the layer part


def _median_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def layer(rows: int, context: int, calls: int) -> dict[str, float]:
    """One layer's attention of ``rows`` single-token requests, both ways."""
    hkv, g, d = 3, 3, 64
    gen = torch.Generator().manual_seed(rows)
    slots = context + rows * 2 * BLOCK * 4
    k_cache = torch.randn(hkv, slots, d, generator=gen).bfloat16()
    v_cache = torch.randn(hkv, slots, d, generator=gen).bfloat16()
    q = torch.randn(rows, hkv, g, d, generator=gen).bfloat16()
    own = [torch.arange(context + 128 * r, context + 128 * r + OWN + r) for r in range(rows)]
    prefix = SharedPrefix(0, context)
    chunks = [Chunk([1], start=context + len(o) - 1, slots=o, prefix=prefix) for o in own]
    plan = plan_step(chunks, block_size=BLOCK, whole_sequences=rows)
    assert plan.decode is not None and plan.sequences is not None
    group, decode, seqs = plan.prefix_groups[0], plan.decode, plan.sequences
    scale = d**-0.5

    def cascade() -> torch.Tensor:
        parts = [_prefix_partial(q, k_cache, v_cache, group, scale), _decode_partial(q, k_cache, v_cache, decode, scale)]
        return merge_partials(parts)[0]

    def kernel() -> torch.Tensor:
        return vllm_attention.decode(q, k_cache, v_cache, seqs, scale)

    diff = (cascade().float() - kernel().float()).abs().max().item()
    return {"cascade_us": _median_us(cascade, calls), "kernel_us": _median_us(kernel, calls), "max_abs_diff": diff}


def forward(fwd: LlamaForward, ids: torch.Tensor, workload: str, rows: int, steps: int,
            reps: int) -> dict[str, object]:
    """One workload (``shared``, ``private`` or ``prefill``), both ways, alternating."""
    n = ids.numel()
    prefix_blocks, own_blocks = n // BLOCK + 1, -(-steps // BLOCK)
    per_request = prefix_blocks + own_blocks  # a private history, then its decode steps

    def arm(whole: int) -> Callable[[], list[torch.Tensor]]:
        kv = KVStorage(fwd.kv_spec(), num_blocks=rows * per_request + prefix_blocks + rows * own_blocks,
                       block_size=BLOCK)
        whole_prompt = [Chunk(ids, start=0, slots=torch.arange(n))]
        if workload == "prefill":
            plan = plan_step(whole_prompt, block_size=BLOCK, whole_sequences=whole)
            return lambda: [fwd(plan, kv)]
        forced = torch.randint(100, 40000, (steps, rows), generator=torch.Generator().manual_seed(1))
        if workload == "shared":
            fwd(plan_step(whole_prompt, block_size=BLOCK), kv)
            prefix = SharedPrefix(0, n)
            own = [kv.slots(list(range(prefix_blocks + r * own_blocks, prefix_blocks + (r + 1) * own_blocks)))
                   for r in range(rows)]
            plans = [plan_step([Chunk(forced[s, r : r + 1], start=n + s, slots=own[r][: s + 1], prefix=prefix)
                                for r in range(rows)], block_size=BLOCK, whole_sequences=whole) for s in range(steps)]
        else:  # each request its own copy of the context, then its own decode steps
            seqs = [kv.slots(list(range(r * per_request, (r + 1) * per_request))) for r in range(rows)]
            for r in range(rows):
                fwd(plan_step([Chunk(ids, start=0, slots=seqs[r][:n])], block_size=BLOCK), kv)
            plans = [plan_step([Chunk(forced[s, r : r + 1], start=n + s, slots=seqs[r][: n + s + 1])
                                for r in range(rows)], block_size=BLOCK, whole_sequences=whole) for s in range(steps)]
        return lambda: [fwd(p, kv) for p in plans]

    arms = {"cascade": arm(0), "kernel": arm(vllm_attention.MAX_ROWS)}
    return side_by_side(arms, reps, 1 if workload == "prefill" else steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layer-rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    ap.add_argument("--calls", type=int, default=200, help="calls per request count in the layer part")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3, 4], help="request counts of the shared decode steps")
    ap.add_argument("--private-rows", type=int, nargs="+", default=[3], help="request counts of the private ones")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=6, help="alternating pairs per request count")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if vllm_attention.status() != "on":
        raise SystemExit(f"vLLM's decode kernel is not available: {vllm_attention.status()}")
    results: dict[str, object] = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                                  "torch": torch.__version__, "context": args.context, "layer": {}, "forward": {}}
    # forward workloads: prefill (one step), shared R and private R (ms per decode step)
    with torch.inference_mode():
        for r in args.layer_rows:
            row = layer(r, args.context, args.calls)
            results["layer"][r] = row  # type: ignore[index]
            print(f"layer, {r:2} requests: cascade {row['cascade_us']:6.0f} µs   kernel {row['kernel_us']:6.0f} µs   "
                  f"max |Δ| {row['max_abs_diff']:.3g}", flush=True)
        fwd = LlamaForward.from_hf(load_model(default_model_dir()).model, dtype=torch.bfloat16)
        ids = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0))
        work = [("prefill", 1), *(("shared", r) for r in args.rows), *(("private", r) for r in args.private_rows)]
        for workload, r in work:
            name = workload if workload == "prefill" else f"{workload} {r}"
            res = forward(fwd, ids, workload, r, args.steps, args.reps)
            results["forward"][name] = res  # type: ignore[index]
            print(summary(f"forward, {name:10}", res), flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
