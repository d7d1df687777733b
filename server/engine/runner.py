"""The model runner: from a step's work items to their logits, one forward per weight set.

::

    work items ──▶ group by weights ──▶ plan_step (batch.py) ──▶ forward ──▶ last-row logits
                   the base's call: the base's rows, every LoRA row (its deltas per row,
                                    from the invocation point on), full modules' rows < IP,
                                    and layer-split modules' filled prefix rows, which join
                                    it at their split S (layers S.. only)
                   a full module's own call: its rows at or after the IP

A layer-split LoRA module (``recompute_layers = k``, split ``S = L - k``) takes its deltas on
its rows before the IP too, from layer S on. Its prefix rows whose lower layers the family
computed are *filled*: they copy the family block's K/V of layers < S and enter the base's
call at layer S from the hidden state the base kept there, after the rows running from layer 0
(the rest of the same request's chunk among them). So one step is one forward of the base's
weights, whatever the splits.

A shared prefix (leading consecutive blocks of a shared context, already written) is read once
for every request of the step that starts with it. The runner counts the rows it computes with
the base's and with the modules' weights (``EngineStats``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from server.engine import vllm_attention
from server.engine.batch import Chunk, SharedPrefix, StepPlan, plan_step
from server.engine.config import EngineStats
from server.engine.forward import Join, LlamaForward
from server.engine.graphs import DecodeGraphs
from server.engine.kinds import kind_of
from server.engine.modules import DecodeModule
from server.engine.projection import (
    LayerSplitProjection,
    LoraBank,
    LowRank,
    Projection,
    RowDeltaProjection,
)
from server.engine.sampling import greedy_ids
from server.engine.scheduler import WorkItem
from server.engine.sequence import Phase, Sequence
from server.kv.storage import KVStorage


class ModelRunner:
    """Runs the base and every decode module's weights over one :class:`KVStorage`."""

    def __init__(
        self, forward: LlamaForward, kv: KVStorage, modules: Mapping[str, DecodeModule], *,
        block_size: int, stats: EngineStats,
    ) -> None:
        self.forward, self.kv, self.block_size, self.stats = forward, kv, block_size, stats
        self.device = forward.weights.device  # the step's index tensors go there; logits come back to the host
        # decode steps of at most this many requests carry their whole sequences, for vLLM's kernel
        serves = vllm_attention.serves(forward.weights.dtype, self.device, forward.weights.shape.head_dim)
        self.whole_sequences = vllm_attention.MAX_ROWS if serves else 0
        self.module_index: dict[str, int] = {}  # LoRA module -> its row id in a step's deltas
        self.lora = LoraBank()  # every LoRA module's deltas, stacked per set of modules in a step
        self.graphs: DecodeGraphs | None = None  # the base call's decode steps from CUDA graphs
        self._own: dict[str, LlamaForward] = {}
        for m in modules.values():
            kind_of(m.kind).attach(self, m)

    # ---- what kinds register -----------------------------------------------------------------

    def add_deltas(self, module: str, deltas: Mapping[tuple[int, str], list[LowRank]]) -> int:
        """Register a module's low-rank deltas, applied per row inside the base's call."""
        idx = self.module_index.setdefault(module, len(self.module_index))
        for (layer, proj), updates in deltas.items():
            self.lora.add(idx, layer, proj, updates)
        return idx

    def add_forward(self, module: str, weights: Any) -> None:
        """Register a module whose rows run in a forward of their own weights."""
        self._own[module] = LlamaForward(weights, self.forward.rope)

    # ---- one step ----------------------------------------------------------------------------

    def run(self, work: list[WorkItem], greedy: list[bool] | None = None) -> list[torch.Tensor | int]:
        """Logits of the last row of each work item, in order, on the host. An item with
        ``greedy[i]`` set gets its greedy token instead, chosen on the device with its call's
        other such items in one op (``sampling.greedy_ids``): only the ids travel, not the rows
        (64 rows of a 128k vocabulary are 33 MB). A row holding a NaN travels after all."""
        greedy = greedy if greedy is not None else [False] * len(work)
        calls: dict[str | None, list[int]] = {}  # None: the base's; a name: a full module's own
        for i, (seq, start, _) in enumerate(work):
            own = kind_of(seq.module.kind).own_forward and start >= seq.invocation_point
            calls.setdefault(seq.module.name if own else None, []).append(i)
        out: list[torch.Tensor | int | None] = [None] * len(work)
        for key, idx in calls.items():
            items = [work[i] for i in idx]
            if key is None:
                parts = self._parts(items)
                ends = [start + n for _, start, n in items]
                logits = self._base_call(parts)
                last = {p.item: r for r, p in enumerate(parts) if p.start + p.n == ends[p.item]}  # the part ending it
                rows = self._to_host(logits, [last[j] for j in range(len(items))], [greedy[i] for i in idx])
            else:
                parts = [_Part(j, *it, 0) for j, it in enumerate(items)]
                plan = self._plan([self._chunk(*it) for it in items])
                rows = self._to_host(self._own[key](plan, self.kv), list(range(len(items))), [greedy[i] for i in idx])
            for i, row in zip(idx, rows, strict=True):
                out[i] = row
            self._count_rows(parts, own=key is not None)
        return out  # type: ignore[return-value]  # every index was filled by its call

    def _plan(self, chunks: list[Chunk]) -> StepPlan:
        return plan_step(chunks, block_size=self.block_size, device=self.device, whole_sequences=self.whole_sequences)

    @staticmethod
    def _parts(items: list[WorkItem]) -> list[_Part]:
        """The base call's rows in forward order: positions a fill covers join at their split
        (the deeper, the later), the others start at layer 0. An item cut in two (its fill, then
        the rest) has its rows from layer 0 first; its logits are those of its later positions."""
        parts = []
        for j, (seq, start, n) in enumerate(items):
            if start < seq.fill_end:
                assert seq.split_layer is not None
                filled = min(n, seq.fill_end - start)
                parts.append(_Part(j, seq, start, filled, seq.split_layer))
                start, n = start + filled, n - filled
            if n:
                parts.append(_Part(j, seq, start, n, 0))
        return sorted(parts, key=lambda p: p.layer)  # stable: an item's tail (layer 0) before its fill

    def _base_call(self, parts: list[_Part]) -> torch.Tensor:
        """One forward for the base, every LoRA row and every fill; logits of each part's last row."""
        chunks = [self._chunk(p.seq, p.start, p.n) for p in parts]
        layers = sorted({p.layer for p in parts})
        if layers == [0]:
            plan = self._plan(chunks)
            if self.graphs is not None:
                lora = any(p.seq.module_index >= 0 for p in parts)
                rows = torch.tensor([p.seq.module_index for p in parts]) if lora else None
                logits = self.graphs.run(plan, rows, lambda: self._eager(plan, parts))  # None: not graphable
                if logits is not None:
                    return logits
            return self._eager(plan, parts)
        stages = []  # (layer, the plan from it on, its joining rows' source slots)
        for layer in layers:
            upto = sum(1 for p in parts if p.layer <= layer)
            plan = self._plan(chunks[:upto])
            stages.append((layer, plan, self._copy_lower(layer, [p for p in parts if p.layer == layer])))
        first, plan, src = stages[0]
        joins = [Join(layer, self.kv.hidden[layer].index_select(0, s), p) for layer, p, s in stages[1:]]
        return self.forward(plan, self.kv, projection=self._projection(parts), first_layer=first,
                            hidden=None if first == 0 else self.kv.hidden[first].index_select(0, src),
                            joins=joins)

    def _eager(self, plan: Any, parts: list[_Part]) -> torch.Tensor:
        return self.forward(plan, self.kv, projection=self._projection(parts))

    def _to_host(self, logits: torch.Tensor, rows: list[int], greedy: list[bool]) -> list[torch.Tensor | int]:
        """The host's share of a call's ``logits`` [parts, vocab]: for each of ``rows`` its greedy
        id where ``greedy`` says so (and the row holds no NaN), else the row itself."""
        got: dict[int, torch.Tensor | int] = {}
        picked = [r for r, g in zip(rows, greedy, strict=True) if g]
        if picked:
            ids = self.to_host(greedy_ids(_take(logits, picked))).tolist()
            got.update((r, t) for r, t in zip(picked, ids, strict=True) if t >= 0)
        rest = [r for r in rows if r not in got]
        if rest:
            got.update(zip(rest, self.to_host(_take(logits, rest)), strict=True))
        return [got[r] for r in rows]

    @staticmethod
    def to_host(logits: torch.Tensor) -> torch.Tensor:
        """One copy per call from the device: sampling, stop rules and grammars run on the host."""
        return logits.cpu()

    def _copy_lower(self, split: int, parts: list[_Part]) -> torch.Tensor:
        """Filled rows: copy the family blocks' K/V of layers below ``split`` into the rows' own
        slots; returns the family slots they read (where the base kept their hidden state)."""
        if not split:
            return torch.empty(0, dtype=torch.long)
        src, dst = [], []
        for p in parts:
            seq = p.seq
            family = self.kv.slots(seq.fill_blocks)
            src.append(family[p.start - seq.fill_start : p.start + p.n - seq.fill_start])
            assert seq.slot_table is not None
            dst.append(seq.slot_table[p.start : p.start + p.n])
        s, d = torch.cat(src).to(self.device), torch.cat(dst).to(self.device)
        for layer in range(split):
            self.kv.k[layer].index_copy_(1, d, self.kv.k[layer].index_select(1, s))
            self.kv.v[layer].index_copy_(1, d, self.kv.v[layer].index_select(1, s))
        return s

    def _chunk(self, seq: Sequence, start: int, n: int) -> Chunk:
        bs = self.block_size
        # The shared prefix: leading consecutive blocks of the shared context, already written.
        # Every agent of one context gets the same one, so the batch reads it once.
        run = min(seq.prefix_blocks, start // bs)
        prefix = SharedPrefix(seq.blocks[0], run * bs) if run else None
        assert seq.slot_table is not None
        return Chunk(seq.tokens[start : start + n], start, seq.slot_table[run * bs : start + n], prefix)

    def _projection(self, parts: list[_Part]) -> Projection | None:
        """Each row's module, layer by layer: LoRA rows from the IP on; a split module's prefix
        rows from its split on (a filled part runs only from there)."""
        if not any(p.seq.module_index >= 0 for p in parts):
            return None
        splits = {p.seq.split_layer for p in parts if p.seq.split_layer is not None and p.start < p.seq.invocation_point}
        lowest = min(p.layer for p in parts)
        out: list[tuple[int, Projection]] = []
        for depth in sorted({lowest, *(s for s in splits if s > lowest)}):  # the rows' modules from this layer on
            rows = []
            for p in parts:
                seq = p.seq
                if p.layer > depth:
                    continue  # not running yet
                if seq.module_index < 0:
                    rows.append(torch.full((p.n,), -1))
                    continue
                own = torch.arange(p.start, p.start + p.n) >= seq.invocation_point
                if seq.split_layer is not None and depth >= seq.split_layer:
                    own = torch.ones_like(own)  # its prefix rows too, from its split on
                rows.append(torch.where(own, seq.module_index, -1))
            out.append((depth, RowDeltaProjection(torch.cat(rows), self.lora, self.device)))
        return out[0][1] if len(out) == 1 else LayerSplitProjection(tuple(out))

    def _count_rows(self, parts: list[_Part], *, own: bool) -> None:
        for p in parts:
            seq, start, n = p.seq, p.start, p.n
            if p.layer:  # a fill: the module's top layers only; the family computed the rest
                self.stats.recomputed_prefix_tokens += n
                self.stats.split_saved_layer_rows += n * p.layer
            if own or p.layer:
                module = n  # a module's own call, or a fill
            elif seq.module_index >= 0:  # delta rows from the IP on
                module = max(0, start + n - max(start, seq.invocation_point))
            else:
                module = 0
            self.stats.module_rows += module
            self.stats.base_rows += n - module
            if seq.phase is Phase.PREFILL:
                self.stats.prefill_tokens += n
                if seq.exported:
                    self.stats.exported_prefill_tokens += n
            else:
                self.stats.decode_tokens += n


@dataclass(frozen=True, slots=True)
class _Part:
    """Positions ``[start, start + n)`` of work item ``item`` (``seq``), entering the step's
    forward at ``layer`` (a fill: the module's split; else 0)."""

    item: int
    seq: Sequence
    start: int
    n: int
    layer: int


def _take(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``, without a copy when that is every row in order."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[torch.tensor(rows, device=logits.device)]
