"""Decode steps replayed from CUDA graphs, at a bounded set of shapes (docs/gpu.md).

A decode step launches a few dozen kernels per layer; on a GPU, at small batches or on a small
model, the launches cost more than the kernels. A CUDA graph replays a captured step in one
launch, but only over fixed shapes and tensors fixed in place, so a graphable step is padded:

* rows up to the next batch bucket (1, 2, 4, 8, 16, 32, 64); a padding row reads and writes
  one scratch slot that no request owns, and its logits are dropped;
* each row's own slots (the decode gather, which grows every step) up to the next multiple of
  ``WIDTH`` columns, masked.

A graph is kept per (rows, width, prefix layout, module set): one team decoding over one shared
context replays one graph for ``WIDTH`` steps at a time. Graphable: the base's call of a step
whose every row decodes (no prefill chunk), with LoRA rows or none, over at most
``MAX_PREFIXES`` shared prefixes (teams on different contexts, tenants, private prefills): with
several, each prefix's rows are a mask filled every step, and every row attends every prefix.
Anything else runs eagerly.

Each graph's first replay is compared with the same step run eagerly (within
:func:`replay_tolerance`); a graph that disagrees (or fails to capture) is logged
(``decode_graph``) and graphs stay off for that engine. Mode
``padded`` runs the same padded step eagerly, without capture: the CPU tests check the padding
with it.

>>> bucket(3), bucket(64), bucket(65), width_bucket(1), width_bucket(129)
(4, 64, None, 128, 256)
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from server.engine.batch import DecodeGroup, StepPlan
from server.engine.cuda import capture_graph, new_graph_pool
from server.engine.forward import LlamaForward
from server.engine.projection import LoraBank, RowDeltaProjection, modules_of
from server.kv.storage import KVStorage

log = logging.getLogger("agentshare.engine")

BATCHES = (1, 2, 4, 8, 16, 32, 64)
WIDTH = 128
MAX_GRAPHS = 24
"""Graphs kept (least recently replayed dropped first); each holds its padded buffers."""


def replay_tolerance(dtype: torch.dtype) -> float:
    """How far a graph's first replay may lie from the eager step, relative to the step's largest
    logit: 1e-4 in fp32; 0.1 in half precision.

    A padded step reduces in another order than the eager one, and in bf16 that alone moves the
    logits: on the CPU the same rows batched differently moved by up to 2.3 % of the largest
    logit (Llama 1B shape, random weights, three LoRA rows), the padded step by up to 3.2 %; on
    an H200 the 8B shape's LoRA replays moved by 2.6-5.4 %, which the former 2 % turned into
    graphs off for the engine. A replay that reads a stale buffer or another row's KV is off by
    the size of the logits themselves; fp32 keeps the tight check.

    >>> replay_tolerance(torch.float32), replay_tolerance(torch.bfloat16)
    (0.0001, 0.1)
    """
    return 1e-4 if dtype == torch.float32 else 0.1


def bucket(rows: int) -> int | None:
    """The batch bucket of ``rows`` decoding rows (None: too many for a graph)."""
    return next((b for b in BATCHES if b >= rows), None)


def width_bucket(width: int) -> int:
    return -(-width // WIDTH) * WIDTH


MAX_PREFIXES = 8
"""Prefixes a graphable step may read. With several, every row attends every prefix (masked to
its own), so the attention over prefixes costs that many times the one a row needs; each
prefix's blocks are still read once a step, as in the eager step. Not yet measured on a GPU."""


def graphable(plan: StepPlan) -> bool:
    """A step of decoding rows only, every row's logits returned, reading at most
    ``MAX_PREFIXES`` shared prefixes (which rows read which lives on the device: a membership
    mask per prefix, filled each step)."""
    d = plan.decode
    return (d is not None and d.rows is None and not plan.chunks and plan.logit_rows is None
            and bucket(plan.num_tokens) is not None and len(plan.prefix_groups) <= MAX_PREFIXES)


@dataclass(slots=True)
class _Graph:
    plan: StepPlan  # over the padded buffers below
    projection: RowDeltaProjection | None
    graph: Any = None  # torch.cuda.CUDAGraph, once captured
    out: torch.Tensor | None = None  # the captured step's logits
    checked: bool = False
    replays: int = 0  # steps this graph served


class DecodeGraphs:
    """The padded decode steps of one engine's base forward; ``mode`` ``cuda`` (capture and
    replay), ``padded`` (the padded step, eagerly) or ``off``."""

    def __init__(self, forward: LlamaForward, kv: KVStorage, bank: LoraBank, *, scratch_slot: int, mode: str,
                 tolerance: float) -> None:
        if mode not in ("cuda", "padded", "off"):
            raise ValueError(f"decode graph mode {mode!r}: cuda, padded or off")
        self.forward, self.kv, self.bank = forward, kv, bank
        self.scratch, self.mode, self.tolerance = scratch_slot, mode, tolerance
        self.device = forward.weights.device
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._pool: Any = None
        self.replays = 0  # steps served by a graph (or, padded, by the padded path)
        self.captures = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def reset(self, forward: LlamaForward) -> None:
        """A new base forward: the graphs of the old one are dropped."""
        self.forward = forward
        self._graphs.clear()

    def run(self, plan: StepPlan, row_modules: torch.Tensor | None,
            eager: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """Logits of the step's rows, or None: not graphable (the caller runs it eagerly).

        ``row_modules``: each row's LoRA module index (-1: the base), on the host; None: no
        LoRA row in the step. ``eager``: the step as the caller runs it without graphs (each
        graph's first replay is checked against it)."""
        if not self.enabled or not graphable(plan):
            return None
        assert plan.decode is not None
        rows = plan.num_tokens
        padded_rows = bucket(rows)
        assert padded_rows is not None
        width = width_bucket(plan.decode.gather.shape[1])
        modules = () if row_modules is None else modules_of(row_modules)
        prefix = tuple((g.slot_start, g.num_tokens) for g in plan.prefix_groups)
        key = (padded_rows, width, prefix, modules)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._buffers(plan, padded_rows, width, row_modules)
            if len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        self._fill(g, plan, row_modules)
        if self.mode == "padded":
            out = self.forward(g.plan, self.kv, projection=g.projection)
            self.replays += 1
            g.replays += 1
            return out[:rows]
        return self._replay(g, plan, eager)

    # ---- the padded buffers ------------------------------------------------------------------

    def _buffers(self, plan: StepPlan, rows: int, width: int, row_modules: torch.Tensor | None) -> _Graph:
        dev = self.device
        if any(p.rows is not None for p in plan.prefix_groups):  # rows read different prefixes
            groups = tuple(replace(p, rows=None, member=torch.full((rows,), float("-inf"), device=dev))
                           for p in plan.prefix_groups)
        else:
            groups = tuple(replace(p) for p in plan.prefix_groups)
        decode = DecodeGroup(None, torch.full((rows, width), self.scratch, dtype=torch.long, device=dev),
                             torch.full((rows, 1, 1, width), float("-inf"), dtype=plan.decode.mask.dtype,  # type: ignore[union-attr]
                                        device=dev))
        padded = StepPlan(token_ids=torch.zeros(rows, dtype=torch.long, device=dev),
                          positions=torch.zeros(rows, dtype=torch.long, device=dev),
                          write_slots=torch.full((rows,), self.scratch, dtype=torch.long, device=dev),
                          prefix_groups=groups, decode=decode, chunks=(), logit_rows=None)  # _fill checks the real step's positions
        projection = None
        if row_modules is not None:
            projection = RowDeltaProjection(self._pad_rows(row_modules, rows), self.bank, dev)
        return _Graph(padded, projection)

    def _pad_rows(self, row_modules: torch.Tensor, rows: int) -> torch.Tensor:
        out = torch.full((rows,), -1, dtype=row_modules.dtype)
        out[: row_modules.numel()] = row_modules
        return out

    def _fill(self, g: _Graph, plan: StepPlan, row_modules: torch.Tensor | None) -> None:
        """Copy this step into the graph's buffers; padding rows get the scratch slot."""
        n, p = plan.num_tokens, g.plan
        assert plan.decode is not None and p.decode is not None
        self.forward.check_positions(plan)  # the padded plan's own positions are never read back
        w = plan.decode.gather.shape[1]
        p.token_ids[:n].copy_(plan.token_ids)
        p.positions[:n].copy_(plan.positions)
        p.write_slots[:n].copy_(plan.write_slots)
        p.write_slots[n:].fill_(self.scratch)
        p.decode.gather.fill_(self.scratch)
        p.decode.gather[:n, :w].copy_(plan.decode.gather)
        p.decode.mask.fill_(float("-inf"))
        p.decode.mask[:n, ..., :w].copy_(plan.decode.mask)
        p.decode.mask[n:, ..., 0] = 0.0  # a padding row attends its scratch slot
        for group, padded in zip(plan.prefix_groups, p.prefix_groups, strict=True):
            if padded.member is not None:
                padded.member.fill_(float("-inf"))
                if group.rows is None:
                    padded.member[:n] = 0.0
                else:
                    padded.member[group.rows] = 0.0
        if g.projection is not None and row_modules is not None:
            g.projection.set_rows(self._pad_rows(row_modules, g.plan.num_tokens))

    # ---- CUDA ----------------------------------------------------------------------------------

    def _replay(self, g: _Graph, plan: StepPlan, eager_step: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        rows = plan.num_tokens
        try:
            if g.graph is None:
                self._capture(g)
            g.graph.replay()
        except Exception as exc:  # capture refused an op: eager from now on
            self._disable(f"capture failed: {type(exc).__name__}: {exc}")
            return None
        assert g.out is not None
        out = g.out[:rows].clone()
        self.replays += 1
        g.replays += 1
        if not g.checked:  # the first replay of each graph against the eager step
            eager = eager_step()
            err = float((out.float() - eager.float()).abs().max())
            scale = float(eager.float().abs().max()) or 1.0
            if err > self.tolerance * scale:
                self._disable(f"a replay differs from the eager step by {err:.3g} (logits up to {scale:.3g})")
                return eager
            g.checked = True
        return out

    def _capture(self, g: _Graph) -> None:
        """Warm up (caches fill: LoRA stacks, attention kernel checks), then capture into the
        engine's shared graph pool; the graph makes the row masks itself, from the row map's
        buffer."""
        if self._pool is None:
            self._pool = new_graph_pool()
        projection = g.projection
        g.graph, g.out = capture_graph(lambda: self.forward(g.plan, self.kv, projection=projection),
                                       device=self.device, pool=self._pool,
                                       before=projection.forget_masks if projection is not None else _nothing)
        self.captures += 1

    def _disable(self, why: str) -> None:
        log.warning("decode graphs off for this engine; steps run eagerly",
                    extra={"event": "decode_graph", "why": why})
        self.mode = "off"
        self._graphs.clear()


def _nothing() -> None:
    return None
