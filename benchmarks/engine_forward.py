"""Own forward vs transformers' forward on the default model (SmolLM2-135M), side by side.

Prefill tokens/s of one-shot prompts, and decode tokens/s of a batch of requests that share a
prompt (ours: cascade over one shared prefix; transformers: a batched KV cache), in fp32 and
bf16. Medians of ``--reps`` runs. Not a test: figures depend on the machine.

    python benchmarks/engine_forward.py --threads 2 --json results/engine_forward.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from server.engine.batch import Chunk, SharedPrefix, plan_step
from server.engine.forward import LlamaForward
from server.kv.storage import KVStorage
from server.models.loader import default_model_dir, load_model

BLOCK = 16


def _side_by_side(ours: Callable[[], object], theirs: Callable[[], object], reps: int, work: int) -> dict[str, float]:
    """Median throughput of each arm; the arms alternate (A B A B ...) so that load from other
    processes on this noisy machine hits both alike."""
    ours(), theirs()  # warm-up
    times: dict[str, list[float]] = {"ours": [], "transformers": []}
    for _ in range(reps):
        for name, fn in (("ours", ours), ("transformers", theirs)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {f"{name}_tok_s": work / statistics.median(ts) for name, ts in times.items()}


def _ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def bench_prefill(model: torch.nn.Module, fwd: LlamaForward, n: int, reps: int) -> dict[str, float]:
    ids = _ids(n, fwd.weights.shape.vocab_size)
    kv = KVStorage(fwd.kv_spec(), num_blocks=n // BLOCK + 1, block_size=BLOCK)
    plan = plan_step([Chunk(ids, start=0, slots=torch.arange(n))], block_size=BLOCK)

    def ours() -> None:
        fwd(plan, kv)

    def theirs() -> None:
        with torch.inference_mode():
            model(ids[None], logits_to_keep=1, use_cache=False)

    return _side_by_side(ours, theirs, reps, n)


def bench_decode(
    model: torch.nn.Module, fwd: LlamaForward, batch: int, prompt: int, steps: int, reps: int
) -> dict[str, float]:
    """``batch`` requests on one shared ``prompt``-token prefix, each decoding ``steps`` tokens."""
    vocab = fwd.weights.shape.vocab_size
    ids = _ids(prompt, vocab)
    forced = _ids(batch * steps, vocab, seed=1).view(steps, batch)
    prefix_blocks = -(-prompt // BLOCK)
    own_blocks = -(-steps // BLOCK)
    kv = KVStorage(fwd.kv_spec(), num_blocks=prefix_blocks + batch * own_blocks, block_size=BLOCK)
    fwd(plan_step([Chunk(ids, start=0, slots=torch.arange(prompt))], block_size=BLOCK), kv)
    prefix = SharedPrefix(0, prompt)
    own = [kv.slots(list(range(prefix_blocks + r * own_blocks, prefix_blocks + (r + 1) * own_blocks)))
           for r in range(batch)]

    def ours() -> None:
        for s in range(steps):
            chunks = [Chunk(forced[s, r : r + 1], start=prompt + s, slots=own[r][: s + 1], prefix=prefix)
                      for r in range(batch)]
            fwd(plan_step(chunks, block_size=BLOCK), kv)

    with torch.inference_mode():
        base = model(ids[None].expand(batch, prompt), use_cache=True).cache

    def theirs() -> None:
        import copy

        cache = copy.deepcopy(base)
        with torch.inference_mode():
            for s in range(steps):
                model(forced[s][:, None], cache=cache, use_cache=True, logits_to_keep=1)

    return _side_by_side(ours, theirs, reps, batch * steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    results: dict[str, object] = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "runs": [],
    }
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        loaded = load_model(default_model_dir(), dtype=dtype)
        fwd = LlamaForward.from_hf(loaded.model)
        for n in args.prompts:
            r = {"dtype": dtype_name, "kind": "prefill", "tokens": n, **bench_prefill(loaded.model, fwd, n, args.reps)}
            results["runs"].append(r)  # type: ignore[union-attr]
            print(f"{dtype_name:9} prefill {n:5} tok: ours {r['ours_tok_s']:8.0f} tok/s   "
                  f"transformers {r['transformers_tok_s']:8.0f} tok/s", flush=True)
        for b in args.batches:
            r = {"dtype": dtype_name, "kind": "decode", "batch": b, "prompt": args.decode_prompt,
                 "steps": args.steps,
                 **bench_decode(loaded.model, fwd, b, args.decode_prompt, args.steps, args.reps)}
            results["runs"].append(r)  # type: ignore[union-attr]
            print(f"{dtype_name:9} decode batch {b:2} (prefix {args.decode_prompt}): ours "
                  f"{r['ours_tok_s']:6.1f} tok/s   transformers {r['transformers_tok_s']:6.1f} tok/s",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
