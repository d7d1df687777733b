"""The one place where the forward multiplies activations by weights.

Every matmul of the forward goes through a :class:`Projection`: ``project(x, linear, layer=,
name=)``, with ``x`` [T, in] the step's rows. The base projection is a plain ``F.linear``. A
per-row adapter (LoRA) plugs in here without touching the model math: built per step from the
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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

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
        return F.linear(x, linear.weight, linear.bias)


@dataclass(frozen=True, slots=True)
class LowRank:
    """``delta(x) = scale * (x @ a.T) @ b.T`` written into output columns ``[col, col + b.rows)``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out_slice, r]
    scale: float = 1.0
    col: int = 0


@dataclass(frozen=True, slots=True)
class RowDeltaProjection:
    """Base projection plus, for rows whose module id is ``m >= 0``, module ``m``'s deltas.

    ``row_modules`` [T]: -1 for rows computed with base weights (positions < invocation point),
    otherwise an index into the step's modules. ``deltas[(m, layer, name)]`` lists the low-rank
    updates of module ``m`` on that projection. Rows are grouped per module: one pair of small
    matmuls per (module, projection) present in the step, never a forward per adapter.

    >>> import torch
    >>> from server.engine.weights import Linear
    >>> lin = Linear(torch.zeros(2, 2))
    >>> d = {(0, 0, "o"): [LowRank(a=torch.eye(1, 2), b=torch.ones(2, 1))]}
    >>> p = RowDeltaProjection(torch.tensor([-1, 0]), d)
    >>> p(torch.ones(2, 2), lin, layer=0, name="o").tolist()
    [[0.0, 0.0], [1.0, 1.0]]
    """

    row_modules: torch.Tensor
    deltas: Mapping[tuple[int, int, str], list[LowRank]]

    def __call__(self, x: torch.Tensor, linear: Linear, *, layer: int, name: str) -> torch.Tensor:
        y = F.linear(x, linear.weight, linear.bias)
        for module in torch.unique(self.row_modules[self.row_modules >= 0]).tolist():
            updates = self.deltas.get((module, layer, name))
            if not updates:
                continue
            rows = (self.row_modules == module).nonzero().squeeze(1)
            xr = x.index_select(0, rows)
            for u in updates:
                delta = F.linear(F.linear(xr, u.a), u.b) * u.scale
                y[rows, u.col : u.col + u.b.shape[0]] += delta
        return y
