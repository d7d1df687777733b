"""The one place where the forward multiplies activations by weights.

Every matmul of the forward goes through a :class:`Projection`: ``project(x, linear, layer=,
name=)``, with ``x`` [T, in] the step's rows. The base projection is the linear itself
(``F.linear``, or oneDNN's kernel when packed). A per-row adapter (LoRA) plugs in here without touching the model math: built per step from the
rows' module ids — ``-1`` (base weights) for positions before a request's invocation point,
the module's index from it on (docs/design.md §2) — it adds its low-rank delta to the rows of each
module only (:class:`RowDeltaProjection`).

>>> import torch
>>> from server.engine.weights import Linear
>>> lin = Linear(torch.eye(2))
>>> BaseProjection()(torch.ones(3, 2), lin, layer=0, name="o").tolist()
[[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from server.engine.weights import Linear


class Projection(Protocol):
    def __call__(self, x: torch.Tensor, linear: Linear, *, layer: int, name: str) -> torch.Tensor:
        """``x @ linear.weight.T + bias`` for rows [T, in], maybe with per-row adapter deltas.

        ``layer`` is -1 for the lm_head; ``name`` one of ``qkv``, ``o``, ``gate_up``, ``down``,
        ``lm_head`` (q/k/v and gate/up are fused: an adapter of ``q_proj`` writes the ``q``
        slice of ``qkv``'s output).
        """
        ...


@dataclass(frozen=True, slots=True)
class BaseProjection:
    """Base weights for every row."""

    def __call__(self, x: torch.Tensor, linear: Linear, *, layer: int, name: str) -> torch.Tensor:
        return linear(x)


@dataclass(frozen=True, slots=True)
class LowRank:
    """``delta(x) = scale * (x @ a.T) @ b.T`` written into output columns ``[col, col + b.rows)``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out_slice, r]
    scale: float = 1.0
    col: int = 0


class LoraBank:
    """Every LoRA module's low-rank updates, stacked per set of modules that share a step.

    A step's LoRA rows cost three ops per projection whatever the number of modules in it
    (S-LoRA / Punica's batched low-rank product, written densely): the step's modules' ``A``
    matrices stacked ``[R, in]``, each update's ``scale * B`` placed in its output columns of one
    block matrix ``[out, R]``, and a ``[T, R]`` mask that keeps, for each row, the rank columns
    of its own module only::

        y = x @ W.T + ((x @ A_cat.T) * mask) @ B_blk.T

    Stacks are built once per set of modules (a team's set recurs step after step) and kept for
    the last :attr:`max_sets` sets; they grow with the set, which suits teams of a few modules.
    """

    max_sets = 8

    def __init__(self, deltas: Mapping[tuple[int, int, str], list[LowRank]] | None = None) -> None:
        self._deltas: dict[tuple[int, int, str], list[LowRank]] = dict(deltas or {})
        self._sets: OrderedDict[tuple[int, ...], dict[tuple[int, str], _Stack | None]] = OrderedDict()

    def add(self, module: int, layer: int, name: str, updates: list[LowRank]) -> None:
        self._deltas[(module, layer, name)] = updates
        self._sets.clear()

    def stack(self, modules: tuple[int, ...], layer: int, name: str) -> _Stack | None:
        """The stacked updates of ``modules`` (slots in that order) on one projection."""
        stacks = self._sets.get(modules)
        if stacks is None:
            stacks = self._sets[modules] = {}
            if len(self._sets) > self.max_sets:
                self._sets.popitem(last=False)
        else:
            self._sets.move_to_end(modules)
        key = (layer, name)
        if key not in stacks:
            stacks[key] = self._build(modules, layer, name)
        return stacks[key]

    def _build(self, modules: tuple[int, ...], layer: int, name: str) -> _Stack | None:
        parts = [(slot, u) for slot, m in enumerate(modules) for u in self._deltas.get((m, layer, name), [])]
        if not parts:
            return None
        a = torch.cat([u.a for _, u in parts])
        out = max(u.col + u.b.shape[0] for _, u in parts)
        b = a.new_zeros(out, a.shape[0])
        owner, r = [], 0
        for slot, u in parts:
            rank = u.a.shape[0]
            b[u.col : u.col + u.b.shape[0], r : r + rank] = u.b * u.scale
            owner += [slot] * rank
            r += rank
        return _Stack(a, b, tuple(owner), a.float(), b.t().float().contiguous())


@dataclass(frozen=True, slots=True)
class _Stack:
    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R], scale folded in; out may be narrower than the projection
    owner: tuple[int, ...]  # slot of each rank column
    a32: torch.Tensor  # the same in fp32, for a few rows (decode): see RowDeltaProjection
    b32t: torch.Tensor  # [R, out]


_FEW_ROWS = 64
"""Up to this many rows (a decode step) the low-rank product runs in fp32 on fp32 copies of the
stacks: for 3 rows at rank 72 it took 21 µs a projection against 56 µs in bf16, whose kernel's
set-up dominates at that size; bf16 wins on prefill-sized row counts."""


def modules_of(row_modules: torch.Tensor) -> tuple[int, ...]:
    """The modules of a step's rows (``-1``: the base, left out), in ascending order: each one's
    slot in the step's stacked deltas.

    >>> modules_of(torch.tensor([2, -1, 0, 2]))
    (0, 2)
    """
    return tuple(torch.unique(row_modules[row_modules >= 0]).tolist())


class RowDeltaProjection:
    """Base projection plus, for rows whose module id is ``m >= 0``, module ``m``'s deltas.

    ``row_modules`` [T]: -1 for rows computed with base weights (positions < invocation point),
    otherwise an index into the step's modules. ``deltas[(m, layer, name)]`` lists the low-rank
    updates of module ``m`` on that projection (or a :class:`LoraBank` holding them). Every
    module of the step is applied in one batched low-rank product per projection, never a
    forward per adapter.

    >>> import torch
    >>> from server.engine.weights import Linear
    >>> lin = Linear(torch.zeros(2, 2))
    >>> d = {(0, 0, "o"): [LowRank(a=torch.eye(1, 2), b=torch.ones(2, 1))]}
    >>> p = RowDeltaProjection(torch.tensor([-1, 0]), d)
    >>> p(torch.ones(2, 2), lin, layer=0, name="o").tolist()
    [[0.0, 0.0], [1.0, 1.0]]
    """

    __slots__ = ("_bank", "_cols", "_masks", "_modules", "_row_slot")

    def __init__(
        self, row_modules: torch.Tensor, deltas: Mapping[tuple[int, int, str], list[LowRank]] | LoraBank,
        device: torch.device | None = None,
    ) -> None:
        """``row_modules`` on the host (the runner builds them there); the row-to-slot map they
        make goes to ``device`` (None: where ``row_modules`` are), so a step reads nothing back."""
        self._bank = deltas if isinstance(deltas, LoraBank) else LoraBank(deltas)
        self._modules = modules_of(row_modules)
        slot = self.slots_of(row_modules)
        self._row_slot = slot if device is None else slot.to(device)
        self._masks: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._cols: dict[tuple[int, ...], torch.Tensor] = {}  # each layout's slot per rank column

    @property
    def modules(self) -> tuple[int, ...]:
        """The step's modules, in slot order."""
        return self._modules

    def slots_of(self, row_modules: torch.Tensor) -> torch.Tensor:
        """Each row's slot among :attr:`modules` (-1: base weights), on the host."""
        slot = torch.full_like(row_modules, -1)
        for s, m in enumerate(self._modules):
            slot[row_modules == m] = s
        return slot

    def set_rows(self, row_modules: torch.Tensor) -> None:
        """Point the rows at new modules of the same set, in place (a captured graph reads
        the row map where it was)."""
        self._row_slot.copy_(self.slots_of(row_modules), non_blocking=True)
        self.forget_masks()

    def forget_masks(self) -> None:
        """Drop the masks made from the row map: the next forward makes them again (a graph
        captured then holds the ops that make them, so a replay reads the row map anew)."""
        self._masks.clear()

    def __call__(self, x: torch.Tensor, linear: Linear, *, layer: int, name: str) -> torch.Tensor:
        y = linear(x)
        if not self._modules:
            return y
        st = self._bank.stack(self._modules, layer, name)
        if st is None:
            return y
        out = st.b.shape[0]
        target = y if out == y.shape[1] else y[:, :out]
        if x.shape[0] <= _FEW_ROWS and x.dtype != torch.float32:
            low = torch.mm(x.float(), st.a32.t()).mul_(self._mask(st.owner, torch.float32))
            target.add_(torch.mm(low, st.b32t))
        else:
            low = torch.mm(x, st.a.t()).mul_(self._mask(st.owner, x.dtype))
            target.addmm_(low, st.b.t())
        return y

    def _mask(self, owner: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """[T, R]: 1 where rank column ``j`` belongs to the row's own module (one per layout)."""
        key = (owner, dtype)
        mask = self._masks.get(key)
        if mask is None:
            cols = self._cols.get(owner)
            if cols is None:  # made once, from the host: never inside a graph's capture
                cols = self._cols[owner] = torch.tensor(owner, dtype=self._row_slot.dtype, device=self._row_slot.device)
            mask = self._masks[key] = (self._row_slot[:, None] == cols[None, :]).to(dtype)
        return mask


@dataclass(frozen=True, slots=True)
class LayerSplitProjection:
    """Per-row adapters that change with depth: ``parts[j] = (first layer, projection)``, in
    ascending order of first layer; a layer uses the last part that starts at or below it (the
    lm_head, layer -1, the deepest). A layer-split module's prefix rows take the base weights
    below its split and its own from the split on.

    >>> import torch
    >>> from server.engine.weights import Linear
    >>> d = {(0, layer, "o"): [LowRank(a=torch.eye(1, 2), b=torch.ones(2, 1))] for layer in range(3)}
    >>> p = LayerSplitProjection(((0, RowDeltaProjection(torch.tensor([-1]), d)),
    ...                           (2, RowDeltaProjection(torch.tensor([0]), d))))
    >>> [p(torch.ones(1, 2), Linear(torch.zeros(2, 2)), layer=i, name="o")[0, 0].item() for i in range(3)]
    [0.0, 0.0, 1.0]
    """

    parts: tuple[tuple[int, Projection], ...]

    def __call__(self, x: torch.Tensor, linear: Linear, *, layer: int, name: str) -> torch.Tensor:
        chosen = self.parts[0][1]
        for first, projection in self.parts[1:]:
            if layer >= 0 and layer < first:
                break
            chosen = projection
        return chosen(x, linear, layer=layer, name=name)
