"""The base model as a decode module: its rows are the base's, in the base's own call."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from server.engine.weights import ModelShape

if TYPE_CHECKING:
    from server.engine.modules import DecodeModule
    from server.engine.runner import ModelRunner


class Base:
    name = "base"
    own_forward = False

    def load(self, path: Path, *, name: str, shape: ModelShape, dtype: torch.dtype) -> Any:
        return None  # the engine's own weights

    def attach(self, runner: ModelRunner, module: DecodeModule) -> None:
        return None
