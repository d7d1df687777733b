"""Replay the Mooncake trace through the block pool at several capacities (no model).

Each hash id stands for one block (block_size=1). Prints capacity -> LRU hit ratio beside the
ideal (unbounded) ratio, and can write the curve as JSON.

    python benchmarks/pool_trace_curve.py [--json results/pool_trace_curve.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from server.kv.pool import BlockPool
from server.kv.trace import DEFAULT_TRACE, TRACE_BLOCK_TOKENS, load_trace, replay

CAPACITIES = [1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 128_000]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--capacities", type=int, nargs="*", default=CAPACITIES)
    ap.add_argument("--json", type=Path, help="write the curve here")
    args = ap.parse_args()

    trace = load_trace(args.trace)
    total = sum(len(r.hash_ids) for r in trace)
    rows = []
    print(f"{len(trace)} requests, {total} blocks of {TRACE_BLOCK_TOKENS} tokens")
    print(f"{'capacity (blocks)':>18} {'KV tokens':>12} {'hit ratio':>10} {'evictions':>10} {'replay s':>9}")
    for cap in [*args.capacities, total]:
        t0 = time.perf_counter()
        r = replay(BlockPool(cap, 1), trace)
        dt = time.perf_counter() - t0
        label = f"{cap}" if cap != total else f"{cap} (unbounded)"
        print(f"{label:>18} {cap * TRACE_BLOCK_TOKENS:>12} {r.hit_ratio:>10.4f} {r.evictions:>10} {dt:>9.2f}")
        rows.append({"capacity_blocks": cap, "unbounded": cap == total, "hit_ratio": r.hit_ratio,
                     "hit_blocks": r.hit_blocks, "total_blocks": r.total_blocks,
                     "evictions": r.evictions, "replay_seconds": dt})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"trace": str(args.trace), "curve": rows}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
