"""Two ways of computing the same thing, timed in turn in one process (shared by the engine's
kernel benchmarks: ``engine_linears``, ``engine_attention``, ``decode_history``).

A host whose speed drifts moves both arms of a pair alike, so the ratio of each pair says more
than the ratio of two medians taken minutes apart.

>>> row = side_by_side({"a": lambda: [], "b": lambda: []}, reps=2)
>>> sorted(row), len(row["runs_ms"]["a"])
(['max_logit_diff', 'ms_per_step', 'ratio_max', 'ratio_median', 'ratio_min', 'runs_ms', 'same_argmax'], 2)
>>> summary("x", row).startswith("x: a ")
True
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping

import torch

Arm = Callable[[], list[torch.Tensor]]


def side_by_side(arms: dict[str, Arm], reps: int, per: int = 1) -> dict[str, object]:
    """Run the two ``arms`` once each (a warm-up, and their logits compared), then ``reps`` pairs
    in turn. Times are ms per unit of work (``per`` steps a run); ratios are the second arm's over
    the first's, pair by pair."""
    (first, run_a), (second, run_b) = arms.items()
    a, b = run_a(), run_b()
    diff = max(((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True)), default=0.0)
    same = all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(a, b, strict=True))
    times: dict[str, list[float]] = {first: [], second: []}
    for _ in range(reps):
        for name, fn in arms.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) / per * 1e3)
    ratios = [y / x for x, y in zip(times[first], times[second], strict=True)]
    return {"ms_per_step": {k: statistics.median(v) for k, v in times.items()},
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "max_logit_diff": diff, "same_argmax": same, "runs_ms": times}


def summary(name: str, row: Mapping[str, object]) -> str:
    """One line of a :func:`side_by_side` row: each arm's ms, the second over the first (median,
    range, pairs), and how far their logits were apart."""
    ms = row["ms_per_step"]
    assert isinstance(ms, dict)
    (first, a), (second, b) = ms.items()
    pairs = len(row["runs_ms"][first])  # type: ignore[index]
    return (f"{name}: {first} {a:7.1f} ms/step   {second} {b:7.1f} ms/step   {second}/{first} {row['ratio_median']:.3f} "
            f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f}, {pairs} pairs)   max |Δ logit| {row['max_logit_diff']:.3g}, "
            f"same argmax: {row['same_argmax']}")


def write_json(path: str | None, results: object) -> None:
    """Write a benchmark's figures to ``path`` (None: nowhere)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
