"""The model runner: from a step's work items to their logits, one forward per weight set.

::

    work items ──▶ group by weights ──▶ plan_step (batch.py) ──▶ forward ──▶ last-row logits
                   the base's call: the base's rows, every LoRA row (its deltas per row,
                                    from the invocation point on), full modules' rows < IP
                   a full module's own call: its rows at or after the IP

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
from server.engine.kinds import kind_of
from server.engine.modules import DecodeModule
from server.engine.projection import LoraBank, LowRank, Projection, RowDeltaProjection
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
        self.module_index: dict[str, int] = {}  # LoRA module -> its row id in a step's deltas
        self._lora = LoraBank()  # every LoRA module's deltas, stacked per set of modules in a step
        self._own: dict[str, LlamaForward] = {}
        for m in modules.values():
            kind_of(m.kind).attach(self, m)

    # ---- what kinds register -----------------------------------------------------------------

    def add_deltas(self, module: str, deltas: Mapping[tuple[int, str], list[LowRank]]) -> int:
        """Register a module's low-rank deltas, applied per row inside the base's call."""
        idx = self.module_index.setdefault(module, len(self.module_index))
        for (layer, proj), updates in deltas.items():
            self._lora.add(idx, layer, proj, updates)
        return idx

    def add_forward(self, module: str, weights: Any) -> None:
        """Register a module whose rows run in a forward of their own weights."""
        self._own[module] = LlamaForward(weights, self.forward.rope)

    # ---- one step ----------------------------------------------------------------------------

    def run(self, work: list[WorkItem]) -> list[torch.Tensor]:
        """Logits of the last row of each work item, in order."""
        calls: dict[str | None, list[int]] = {}
        for i, (seq, start, _) in enumerate(work):
            own = kind_of(seq.module.kind).own_forward and start >= seq.invocation_point
            calls.setdefault(seq.module.name if own else None, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(work)
        for name, idx in calls.items():
            items = [work[i] for i in idx]
            plan = plan_step([self._chunk(*it) for it in items], block_size=self.block_size)
            fwd = self.forward if name is None else self._own[name]
            logits = fwd(plan, self.kv, projection=self._projection(items) if name is None else None)
            for i, row in zip(idx, logits, strict=True):
                out[i] = row
            self._count_rows(items, base_call=name is None)
        return out  # type: ignore[return-value]  # every index was filled by its call

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
        rows = []
        for seq, start, n in items:
            pos = torch.arange(start, start + n)
            rows.append(torch.where(pos >= seq.invocation_point, seq.module_index, -1) if seq.module_index >= 0
                        else torch.full((n,), -1))
        return RowDeltaProjection(torch.cat(rows), self._lora)

    def _count_rows(self, items: list[WorkItem], *, base_call: bool) -> None:
        for seq, start, n in items:
            if not base_call:
                module = n  # a module's own call
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
