"""The engine's elementwise work on torch's ops or on vLLM's CPU ops
(``server/engine/vllm_elementwise.py``), side by side in one process, bf16, the default model.

* **decode steps** of R requests over a shared prefix of ``--context`` tokens (``shared R``),
  ``--steps`` steps a run: torch's eager ops against vLLM's, every other kernel the same;
* **prefills** of ``--prefill`` tokens: the fused kernels (AOTInductor, when built on this
  machine; else torch's eager ops) against vLLM's ops.

Each workload alternates its two arms, ``--reps`` pairs, and compares their logits. Needs the
vllm extra (run it with ``.venv-vllm/bin/python``); not a test: the figures depend on the machine.

    .venv-vllm/bin/python benchmarks/engine_elementwise.py --threads 2 --json results/engine_elementwise.json
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable

import torch

from benchmarks.pairs import side_by_side, summary, write_json
from server.engine import vllm_attention, vllm_elementwise
from server.engine.batch import Chunk, SharedPrefix, plan_step
from server.engine.elementwise import KernelSpec, Regions, TorchRegions, eager_regions, load
from server.engine.forward import LlamaForward
from server.kv.storage import KVStorage
from server.models.loader import default_model_dir, load_model

BLOCK = 16


class _Fixed(LlamaForward):
    """A forward whose every step takes the same regions."""

    __slots__ = ()

    def regions(self, rows: int) -> Regions:
        assert self.small is not None
        return self.small


def decode(arms: dict[str, LlamaForward], ids: torch.Tensor, rows: int, steps: int, reps: int) -> dict[str, object]:
    n = ids.numel()
    prefix_blocks, own_blocks = n // BLOCK + 1, -(-steps // BLOCK)
    head_dim = next(iter(arms.values())).weights.shape.head_dim
    whole = vllm_attention.MAX_ROWS if vllm_attention.serves(torch.bfloat16, "cpu", head_dim) else 0
    forced = torch.randint(100, 40000, (steps, rows), generator=torch.Generator().manual_seed(1))

    def arm(fwd: LlamaForward) -> Callable[[], list[torch.Tensor]]:
        kv = KVStorage(fwd.kv_spec(), num_blocks=prefix_blocks + rows * own_blocks, block_size=BLOCK)
        fwd(plan_step([Chunk(ids, start=0, slots=torch.arange(n))], block_size=BLOCK), kv)
        prefix = SharedPrefix(0, n)
        own = [kv.slots(list(range(prefix_blocks + r * own_blocks, prefix_blocks + (r + 1) * own_blocks)))
               for r in range(rows)]
        plans = [plan_step([Chunk(forced[s, r : r + 1], start=n + s, slots=own[r][: s + 1], prefix=prefix)
                            for r in range(rows)], block_size=BLOCK, whole_sequences=whole) for s in range(steps)]
        return lambda: [fwd(p, kv) for p in plans]

    return side_by_side({name: arm(fwd) for name, fwd in arms.items()}, reps, steps)


def prefill(arms: dict[str, LlamaForward], n: int, reps: int) -> dict[str, object]:
    ids = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n))
    plan = plan_step([Chunk(ids, start=0, slots=torch.arange(n))], block_size=BLOCK)

    def arm(fwd: LlamaForward) -> Callable[[], list[torch.Tensor]]:
        kv = KVStorage(fwd.kv_spec(), num_blocks=n // BLOCK + 1, block_size=BLOCK)
        return lambda: [fwd(plan, kv)]

    return side_by_side({name: arm(fwd) for name, fwd in arms.items()}, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3, 16], help="request counts of the decode steps")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 2048], help="prompt lengths of the prefills")
    ap.add_argument("--reps", type=int, default=6, help="alternating pairs per workload")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if vllm_elementwise.status() != "on":
        raise SystemExit(f"vLLM's elementwise ops are not available: {vllm_elementwise.status()}")
    base = LlamaForward.from_hf(load_model(default_model_dir()).model, dtype=torch.bfloat16)
    eager = eager_regions(base.weights.shape.rms_norm_eps)
    ops = LlamaForward(base.weights, base.rope)
    fused_kernels = load(KernelSpec.of(base.weights))
    torch_prefill = TorchRegions(fused_kernels, fused=True) if fused_kernels is not None else eager
    torch_name = "fused" if fused_kernels is not None else "eager"
    results: dict[str, object] = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                                  "torch": torch.__version__, "context": args.context,
                                  "prefill_torch_arm": torch_name, "forward": {}}
    ids = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        work: list[tuple[str, Callable[[], dict[str, object]]]] = [
            *((f"shared {r}", lambda r=r: decode({"torch": _Fixed(base.weights, base.rope, small=eager), "vllm": ops},
                                                  ids, r, args.steps, args.reps)) for r in args.rows),
            *((f"prefill {n}", lambda n=n: prefill({"torch": _Fixed(base.weights, base.rope, small=torch_prefill),
                                                    "vllm": _Fixed(base.weights, base.rope)}, n, args.reps))
              for n in args.prefill)]
        for name, run in work:
            res = run()
            results["forward"][name] = res  # type: ignore[index]
            print(summary(f"{name:12}", res), flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
