"""Decode-module kinds: how each kind is loaded and how the engine computes its rows.

A kind is one file here with one class (the :class:`~server.engine.kinds.api.Kind` protocol),
registered by one line at the end of this file (and its name in the manifest's ``ModuleKind``). The
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

from server.engine.kinds import base, full, lora
from server.engine.kinds.api import Kind, Loaded, Runner
from server.registry import Registry

__all__ = ["KINDS", "Kind", "Loaded", "Runner", "kind_of", "register"]

KINDS = Registry[Kind]("decode-module kind", hint="add one with server.engine.kinds.register")


def register(kind: Kind) -> Kind:
    """Add a kind under its ``name`` (which must be new)."""
    return KINDS.register(kind.name, kind)


kind_of = KINDS.get


register(base.Base())
register(lora.Lora())
register(full.Full())
