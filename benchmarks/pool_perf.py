"""Block pool speed for a 2,048-token prompt, beside one decode step of a SmolLM2-135M-shaped
model, measured in the same run.

The pool's work in a decode step is a block allocation + registration every ``block_size``
tokens per request; its work per request is one match (hashing the prompt's blocks) and one
insert. The model is random-initialised with SmolLM2-135M's configuration: same shapes, same
cost, no weights needed.

    python benchmarks/pool_perf.py [--threads 2] [--json results/pool_perf.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from server.kv.keys import Layout, Namespace
from server.kv.pool import BlockPool

PROMPT = 2048
BLOCK = 16


def timeit(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds per call."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pool_figures(repeat: int) -> dict[str, float]:
    tokens = list(range(1000, 1000 + PROMPT))
    layout = Layout(Namespace.family("f" * 64), Namespace.module("m" * 64, invocation_point=PROMPT - 40))
    pool = BlockPool(4096, BLOCK)

    def insert_cold() -> None:
        m = pool.match(tokens, layout)
        pool.acquire(m, reader="a")
        ids = pool.allocate(m.num_blocks - len(m.block_ids))
        pool.register(m, ids, tokens, layout, computed_by="a")
        pool.commit(ids)
        pool.release([*m.block_ids, *ids])
        pool.allocate(0)

    def evict_all() -> None:  # make the next insert cold again
        pool.release(pool.allocate(pool.capacity))

    cold = []
    for _ in range(repeat):
        evict_all()
        cold.append(timeit(insert_cold, 1))
    keys = pool.keys(tokens, layout)
    hot_match = timeit(lambda: pool.match(tokens, layout), repeat)
    hot_match_prehashed = timeit(lambda: pool.match(tokens, layout, keys=keys), repeat)
    hashing = timeit(lambda: pool.keys(tokens, layout), repeat)

    def hit_and_release() -> None:
        m = pool.match(tokens, layout, keys=keys)
        pool.acquire(m, reader="b")
        pool.release(m.block_ids)

    hot_request = timeit(hit_and_release, repeat)

    # per decode step: one new block for a request every BLOCK tokens
    step_tokens = list(range(BLOCK))
    one = Layout(Namespace.family("g" * 64))

    def grow_one_block() -> None:
        m = pool.match(step_tokens, one)
        ids = pool.allocate(1)
        pool.register(m, ids, step_tokens, one, computed_by="a")
        pool.commit(ids)
        pool.release(ids)

    grow = timeit(grow_one_block, repeat * 10)
    return {
        "hash_2048_tokens_s": hashing,
        "match_hit_2048_tokens_s": hot_match,
        "match_hit_prehashed_s": hot_match_prehashed,
        "request_hit_acquire_release_s": hot_request,
        "insert_cold_2048_tokens_s": statistics.median(cold),
        "grow_one_block_s": grow,
        "lookups_per_s": 1 / hot_match,
        "inserts_per_s": 1 / statistics.median(cold),
    }


def decode_step_seconds(threads: int, repeat: int) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    cfg = LlamaConfig(  # SmolLM2-135M-Instruct's shapes
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, PROMPT))
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past, nxt = out.past_key_values, ids[:, -1:]
        model(nxt, past_key_values=past)  # warm-up
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            model(nxt, past_key_values=past)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    pool = pool_figures(args.repeat)
    step = decode_step_seconds(args.threads, repeat=10)
    per_step_pool = pool["grow_one_block_s"] / BLOCK  # amortised per request per step
    res = {**pool, "decode_step_s_batch1_ctx2048": step,
           "pool_share_of_decode_step": per_step_pool / step,
           "request_pool_overhead_vs_decode_step": (pool["insert_cold_2048_tokens_s"]) / step}
    print(f"prompt {PROMPT} tokens, block {BLOCK}: {PROMPT // BLOCK} blocks")
    print(f"  hash the prompt's block keys   {pool['hash_2048_tokens_s'] * 1e6:9.1f} us")
    print(f"  match (all hit)                {pool['match_hit_2048_tokens_s'] * 1e6:9.1f} us"
          f"   -> {pool['lookups_per_s']:,.0f} lookups/s")
    print(f"  match (all hit, keys given)    {pool['match_hit_prehashed_s'] * 1e6:9.1f} us")
    print(f"  hit: match+acquire+release     {pool['request_hit_acquire_release_s'] * 1e6:9.1f} us")
    print(f"  insert cold (128 blocks)       {pool['insert_cold_2048_tokens_s'] * 1e6:9.1f} us"
          f"   -> {pool['inserts_per_s']:,.0f} inserts/s")
    print(f"  grow a request by one block    {pool['grow_one_block_s'] * 1e6:9.1f} us")
    print(f"decode step, SmolLM2-135M shapes, batch 1, 2,048 context, {args.threads} threads: "
          f"{step * 1e3:.1f} ms")
    print(f"  pool work per request per decode step (amortised): {per_step_pool * 1e6:.2f} us "
          f"= {res['pool_share_of_decode_step']:.2e} of the step")
    print(f"  a whole cold 2,048-token insert = {res['request_pool_overhead_vs_decode_step']:.2%} "
          "of one decode step")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
