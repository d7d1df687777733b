"""What a decode-module kind implements, and what it may use of the engine (protocols only,
so that kinds import neither the runner nor the module records)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from server.engine.forward import LlamaForward
from server.engine.projection import LowRank
from server.engine.weights import ModelShape


class Loaded(Protocol):
    """A loaded decode module, as a kind sees it."""

    @property
    def name(self) -> str: ...

    @property
    def weights(self) -> Any:
        """What the kind's :meth:`Kind.load` returned."""
        ...


class Runner(Protocol):
    """The model runner's registration points (``server/engine/runner.py``)."""

    @property
    def forward(self) -> LlamaForward:
        """The base model's forward."""
        ...

    def add_deltas(self, module: str, deltas: Mapping[tuple[int, str], list[LowRank]]) -> int:
        """Register low-rank deltas applied per row inside the base's call."""
        ...

    def add_forward(self, module: str, weights: Any) -> None:
        """Register a module whose rows run in a forward of their own weights."""
        ...


class Kind(Protocol):
    """One kind of decode module."""

    name: str
    """The kind's name in a module's manifest (``"lora"``)."""
    own_forward: bool
    """Its rows run in a forward of their own weights (False: inside the base's call)."""

    def load(self, path: Path, *, name: str, shape: ModelShape, dtype: torch.dtype,
             device: torch.device = torch.device("cpu")) -> Any:
        """Read the module's weights from ``path`` onto ``device`` (raise ``ModuleLoadError``
        naming the file)."""
        ...

    def attach(self, runner: Runner, module: Loaded) -> None:
        """Make ``runner`` able to compute ``module``'s rows (register its weights)."""
        ...
