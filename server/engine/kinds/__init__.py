"""Decode-module kinds: how each kind is loaded and how the engine computes its rows.

A kind is one file here with one class (see :class:`Kind`), registered by one line below. The
engine never branches on a kind's name: it asks the module's kind.

=========  ==========================================================  ==============
kind       rows from the invocation point on                           own forward
=========  ==========================================================  ==============
``base``   the base weights (the base computes everything)             no
``lora``   the base call, with the module's low-rank deltas per row    no
``full``   a forward of the module's own weights, apart from the base  yes
=========  ==========================================================  ==============

>>> sorted(KINDS), kind_of("lora").own_forward, kind_of("full").own_forward
(['base', 'full', 'lora'], False, True)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from server.engine.weights import ModelShape

if TYPE_CHECKING:
    from server.engine.modules import DecodeModule
    from server.engine.runner import ModelRunner


class Kind(Protocol):
    """One kind of decode module."""

    name: str
    """The kind's name in a module's manifest (``"lora"``)."""
    own_forward: bool
    """Its rows run in a forward of their own weights (False: inside the base's call)."""

    def load(self, path: Path, *, name: str, shape: ModelShape, dtype: torch.dtype) -> Any:
        """Read the module's weights from ``path`` (raise ``ModuleLoadError`` naming the file)."""
        ...

    def attach(self, runner: ModelRunner, module: DecodeModule) -> None:
        """Make ``runner`` able to compute ``module``'s rows (register its weights)."""
        ...


KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Add a kind (its name must be new)."""
    if kind.name in KINDS:
        raise ValueError(f"module kind {kind.name!r} is registered twice")
    KINDS[kind.name] = kind
    return kind


def kind_of(name: str) -> Kind:
    """The registered kind called ``name``; a clear error naming the known ones otherwise."""
    try:
        return KINDS[str(name)]
    except KeyError:
        raise ValueError(f"unknown decode-module kind {str(name)!r}; known: {sorted(KINDS)}") from None


from server.engine.kinds import base, full, lora  # noqa: E402  (each registers itself)

register(base.Base())
register(lora.Lora())
register(full.Full())
