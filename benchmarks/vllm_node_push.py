"""What moving a prefix to a vllm node costs: one 2,048-token prefix of the default model's KV
(bf16, vLLM's 128-token blocks), from one store into another through ``push_blocks`` and a
``StoreReceiver`` over TCP on this host (framing, HMAC, crc32, the node's writes), beside the
same blocks written into a store directly (the floor: reading and writing shared memory).

    python benchmarks/vllm_node_push.py --json benchmarks/recorded/vllm_node_push.json

Loopback TCP is not a network: on a real link add bytes / bandwidth (the figure printed for
10 Gbit/s). No vLLM needed; the bytes are random, as the cost does not depend on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from server.cluster.transport import KVReceiver
from server.vllm.relay import StoreReceiver, push_blocks
from server.vllm.store import KVStore, prefix_blocks

# SmolLM2-135M: 30 layers, 3 KV heads of 64 channels, K and V, bf16 -> bytes of one 128-token block
LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 128
BLOCK_SHAPE = (LAYERS, 2, HEADS, BLOCK, HEAD_DIM * 2)  # uint8 view of bf16
KEY = b"k" * 32


def one_rep(tokens: list[int], root: Path) -> dict[str, float]:
    src = KVStore(root / "src", fmt="f", capacity_bytes=1 << 31, role="src")
    blocks = prefix_blocks(tokens, family="f" * 64, salt="", block_size=BLOCK)
    rng = np.random.default_rng(0)
    for b in blocks:
        src.put(b.key, parent=b.parent, tokens=tokens[b.start:b.end], kv=rng.integers(0, 255, BLOCK_SHAPE, np.uint8))
    # the floor: read each block from one store and write it into another, in this process
    direct = KVStore(root / "direct", fmt="f", capacity_bytes=1 << 31, role="direct")
    t = time.perf_counter()
    for b in blocks:
        kv = src.get(b.key, parent=b.parent, tokens=tokens[b.start:b.end])
        assert kv is not None
        direct.put(b.key, parent=b.parent, tokens=tokens[b.start:b.end], kv=kv)
    direct_s = time.perf_counter() - t

    async def push() -> tuple[float, int]:
        node = KVStore(root / "node", fmt="f", capacity_bytes=1 << 31, role="node")
        receiver = KVReceiver(StoreReceiver(node, "f"), key=KEY)
        await receiver.start()
        try:
            t = time.perf_counter()
            pushed = await push_blocks(src, blocks, tokens, address=receiver.address("tcp"), key=KEY, fmt="f",
                                       codec="bf16", pin="bench", ttl=60, transfer_id=uuid.uuid4().hex)
            return time.perf_counter() - t, pushed.bytes
        finally:
            await receiver.close()

    push_s, nbytes = asyncio.run(push())
    return {"push_s": push_s, "direct_s": direct_s, "bytes": nbytes, "blocks": len(blocks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tokens = list(range(args.tokens))
    reps = []
    for i in range(args.reps):
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
            reps.append(one_rep([t + i * args.tokens for t in tokens], Path(d)))
    push_s = statistics.median(r["push_s"] for r in reps)
    direct_s = statistics.median(r["direct_s"] for r in reps)
    nbytes = reps[0]["bytes"]
    res = {
        "benchmark": "vllm_node_push", "machine": platform.machine(), "tokens": args.tokens, "reps": args.reps,
        "blocks": reps[0]["blocks"], "bytes": nbytes, "push_s_median": round(push_s, 4),
        "direct_s_median": round(direct_s, 4), "push_over_direct": round(push_s / direct_s, 2),
        "push_mb_per_s": round(nbytes / push_s / 1e6, 1),
        "link_10gbit_s": round(nbytes * 8 / 10e9, 4), "runs": reps,
    }
    print(f"{args.tokens} tokens, {res['blocks']} blocks, {nbytes / 1e6:.1f} MB")
    print(f"push over loopback TCP: {push_s:.3f} s median ({res['push_mb_per_s']} MB/s)")
    print(f"store to store in one process: {direct_s:.3f} s (push / direct {res['push_over_direct']}x)")
    print(f"on a 10 Gbit/s link the bytes alone take {res['link_10gbit_s']} s more")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
