"""The base model as a decode module: its rows are the base's, in the base's own call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from server.engine.kinds.api import Loaded, Runner
from server.engine.weights import ModelShape


class Base:
    name = "base"
    own_forward = False

    def load(self, path: Path, *, name: str, shape: ModelShape, dtype: torch.dtype,
             device: torch.device = torch.device("cpu")) -> Any:
        return None  # the engine's own weights

    def attach(self, runner: Runner, module: Loaded) -> None:
        return None
