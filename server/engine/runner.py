"""The model runner: from a step's work items to their logits, one forward per weight set.

::

    work items ──▶ group by weights ──▶ plan_step (batch.py) ──▶ forward ──▶ last-row logits
                   the base's call: the base's rows, every LoRA row (its deltas per row,
                                    from the invocation point on), full modules' rows < IP
                   a full module's own call: its rows at or after the IP
                   a fill call per split layer S: layer-split modules' prefix rows whose
                                    lower layers the family computed: layers S.. only

A layer-split LoRA module (``recompute_layers = k``, split ``S = L - k``) takes its deltas on
its rows before the IP too, from layer S on. In a fill call those rows copy the family block's
K/V of layers < S and start at layer S from the hidden state the base kept there.

A shared prefix (leading consecutive blocks of a shared context, already written) is read once
for every request of the step that starts with it. The runner counts the rows it computes with
the base's and with the modules' weights (``EngineStats``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from server.engine.batch import Chunk, SharedPrefix, plan_step
from server.engine.config import EngineStats
from server.engine.forward import LlamaForward
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

    def run(self, work: list[WorkItem]) -> list[torch.Tensor]:
        """Logits of the last row of each work item, in order."""
        calls: dict[str | int | None, list[int]] = {}  # None: the base's; a name: a full module's; S: a fill
        for i, (seq, start, _) in enumerate(work):
            own = kind_of(seq.module.kind).own_forward and start >= seq.invocation_point
            key: str | int | None = seq.module.name if own else None
            if start < seq.fill_end:
                assert seq.split_layer is not None
                key = seq.split_layer
            calls.setdefault(key, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(work)
        for key, idx in calls.items():
            items = [work[i] for i in idx]
            plan = plan_step([self._chunk(*it) for it in items], block_size=self.block_size, device=self.device)
            if isinstance(key, int):
                logits = self._fill(plan, items, key)
            elif key is None:
                logits = self._base_call(plan, items)
            else:
                logits = self._own[key](plan, self.kv)
            logits = self.to_host(logits)
            for i, row in zip(idx, logits, strict=True):
                out[i] = row
            self._count_rows(items, call="fill" if isinstance(key, int) else "base" if key is None else "own")
        return out  # type: ignore[return-value]  # every index was filled by its call

    def _base_call(self, plan: Any, items: list[WorkItem]) -> torch.Tensor:
        if self.graphs is not None:
            lora = any(seq.module_index >= 0 for seq, _, _ in items)
            rows = torch.tensor([seq.module_index for seq, _, _ in items]) if lora else None
            logits = self.graphs.run(plan, rows, lambda: self._eager(plan, items))  # None: not graphable
            if logits is not None:
                return logits
        return self._eager(plan, items)

    def _eager(self, plan: Any, items: list[WorkItem]) -> torch.Tensor:
        return self.forward(plan, self.kv, projection=self._projection(items))

    @staticmethod
    def to_host(logits: torch.Tensor) -> torch.Tensor:
        """One copy per call from the device: sampling, stop rules and grammars run on the host."""
        return logits.cpu()

    def _fill(self, plan: Any, items: list[WorkItem], split: int) -> torch.Tensor:
        """Layer-split rows over the family's blocks: copy their K/V below ``split``, then run
        layers ``split..`` from the hidden state the base kept there."""
        src, dst = [], []
        for seq, start, n in items:
            family = self.kv.slots(seq.fill_blocks)
            src.append(family[start - seq.fill_start : start + n - seq.fill_start])
            assert seq.slot_table is not None
            dst.append(seq.slot_table[start : start + n])
        s, d = torch.cat(src).to(self.device), torch.cat(dst).to(self.device)
        for layer in range(split):
            self.kv.k[layer].index_copy_(1, d, self.kv.k[layer].index_select(1, s))
            self.kv.v[layer].index_copy_(1, d, self.kv.v[layer].index_select(1, s))
        rows = torch.cat([torch.full((n,), seq.module_index) for seq, _, n in items])
        return self.forward(plan, self.kv, projection=RowDeltaProjection(rows, self.lora, self.device),
                            first_layer=split, hidden=self.kv.hidden[split].index_select(0, s))

    def _chunk(self, seq: Sequence, start: int, n: int) -> Chunk:
        bs = self.block_size
        # The shared prefix: leading consecutive blocks of the shared context, already written.
        # Every agent of one context gets the same one, so the batch reads it once.
        run = min(seq.prefix_blocks, start // bs)
        prefix = SharedPrefix(seq.blocks[0], run * bs) if run else None
        assert seq.slot_table is not None
        return Chunk(seq.tokens[start : start + n], start, seq.slot_table[run * bs : start + n], prefix)

    def _projection(self, items: list[WorkItem]) -> Projection | None:
        if not any(seq.module_index >= 0 for seq, _, _ in items):
            return None
        splits = sorted({seq.split_layer for seq, start, _ in items
                         if seq.split_layer is not None and start < seq.invocation_point})
        parts: list[tuple[int, Projection]] = []
        for depth in [0, *splits]:  # the rows' modules from this layer on
            rows = []
            for seq, start, n in items:
                if seq.module_index < 0:
                    rows.append(torch.full((n,), -1))
                    continue
                pos = torch.arange(start, start + n)
                own = pos >= seq.invocation_point
                if seq.split_layer is not None and depth >= seq.split_layer:
                    own = torch.ones_like(own)  # its prefix rows too, from its split on
                rows.append(torch.where(own, seq.module_index, -1))
            parts.append((depth, RowDeltaProjection(torch.cat(rows), self.lora, self.device)))
        return parts[0][1] if len(parts) == 1 else LayerSplitProjection(tuple(parts))

    def _count_rows(self, items: list[WorkItem], *, call: str) -> None:
        base_call = call == "base"
        for seq, start, n in items:
            if call == "fill":  # the module's top layers only; the family computed the rest
                self.stats.recomputed_prefix_tokens += n
                self.stats.split_saved_layer_rows += n * (seq.split_layer or 0)
            if not base_call:
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
