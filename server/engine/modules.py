"""Decode modules as the engine serves them: identified (``server/modules``), then loaded by
their kind (``server/engine/kinds``).

>>> m = base_module("f" * 64)
>>> m.name, m.kind, m.is_base, m.shares_prefill
('base', 'base', True, True)
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from server.engine.kinds import kind_of
from server.engine.weights import ModelShape
from server.modules.registry import ModuleLoadError, identify
from server.prompt import Placement


@dataclass(frozen=True, slots=True, eq=False)
class DecodeModule:
    """One servable decode module.

    ``shares_prefill``: its positions before the IP are computed by the family's base and
    shared. Otherwise it has a private prefill: IP 0, every position its own (see
    ``server/positions.py``).
    """

    name: str
    kind: str  # a registered kind (server/engine/kinds): "base", "lora", "full"
    digest: str  # identity of the module's weights + manifest: its KV namespace owner
    shares_prefill: bool
    placement: Placement = Placement.TURN
    weights: Any = None
    """What its kind loaded: LoRA deltas by (layer, projection), a full model's weights, or
    None for the base."""
    reason: str = ""  # why a module does or does not share (for logs and /v1/agents)
    recompute_layers: int = 0
    """Top layers whose prefix KV it recomputes from the base's hidden state below them (the
    layer split; 0: it reads the base's KV of every layer)."""
    fidelity: dict[str, Any] | None = field(default=None, compare=False)
    """What sharing costs it, measured by ``finetune --fidelity`` (None: not measured)."""

    @property
    def is_base(self) -> bool:
        return self.kind == "base"

    @property
    def deltas(self) -> Any:
        """A LoRA module's low-rank updates by (layer, fused projection)."""
        return self.weights if self.kind == "lora" else {}


def base_module(family: str, name: str = "base") -> DecodeModule:
    """The base model as a decode module: shares everything, computes everything with the base."""
    return DecodeModule(name, "base", family, shares_prefill=True, reason="the base")


def load_module(
    path: Path | str, *, name: str, family: str, base_families: Collection[str], shape: ModelShape,
    dtype: torch.dtype, device: torch.device = torch.device("cpu"),
) -> DecodeModule:
    """Load the module in ``path`` onto ``device``, for serving beside a base of ``family`` with
    ``shape``; ``base_families``, that base's family at every KV dtype
    (:func:`server.kv.family.base_families`), refuses a LoRA trained on another base."""
    found = identify(path, name=name, family=family, base_families=base_families)
    if found.kind == "base":
        return DecodeModule(name, "base", family, True, found.placement, reason="the base")
    kind = kind_of(found.kind)
    if found.recompute_layers > shape.num_layers:
        raise ModuleLoadError(f"module {name!r}: recompute_layers {found.recompute_layers} exceeds the "
                              f"base's {shape.num_layers} layers")
    weights = kind.load(Path(path), name=name, shape=shape, dtype=dtype, device=device)
    return DecodeModule(name, kind.name, found.digest, found.shares_prefill, found.placement,
                        weights=weights, reason=found.reason, recompute_layers=found.recompute_layers,
                        fidelity=found.fidelity)
