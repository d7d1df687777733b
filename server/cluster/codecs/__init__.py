"""The KV codecs, by name: one class per file, registered here.

::

    base.py   KVCodec (the protocol), KVShape, view()
    raw.py    RawCodec: K | V as one wire dtype's raw bytes
    fp32.py   FP32   "fp32"  raw float32
    bf16.py   BF16   "bf16"  raw bfloat16
    int8.py   Int8   "int8"  per-block int8 with fp16 scales (KIVI-style)

Adding a codec: a file here with a class implementing :class:`KVCodec` (a raw dtype is two
lines on :class:`RawCodec`); below, its import and one ``register(...)`` line. Every name that takes a
codec (``encode``, ``open_sender``, ``RouterConfig.codec``, ``--transfer-codec``) takes any
registered name; the framing, checksum and HMAC around the payload do not change.

>>> names()
('fp32', 'bf16', 'int8')
>>> import torch
>>> get("int8").is_lossy(torch.bfloat16)
True
>>> get("fp8")
Traceback (most recent call last):
...
server.cluster.codecs.UnknownCodec: unknown codec 'fp8'; registered codecs: fp32, bf16, int8 (add one with server.cluster.codecs.register)
"""

from __future__ import annotations

import re
from typing import Any

from server.cluster.codecs.base import KVCodec, KVShape, view
from server.cluster.codecs.bf16 import BF16
from server.cluster.codecs.fp32 import FP32
from server.cluster.codecs.int8 import Int8
from server.cluster.codecs.raw import RawCodec

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_CODECS: dict[str, KVCodec] = {}


class UnknownCodec(ValueError):
    """A codec name that no codec is registered under; the message lists the registered ones."""


def register(codec: KVCodec, *, replace: bool = False) -> KVCodec:
    """Make ``codec`` usable under ``codec.name``; returns it. A taken name needs ``replace``."""
    name = getattr(codec, "name", None)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"a codec's name is lowercase letters, digits, '.', '_' or '-', got {name!r}"
        )
    if name in _CODECS and not replace:
        raise ValueError(
            f"codec {name!r} is already registered ({type(_CODECS[name]).__name__}); "
            "pass replace=True to replace it"
        )
    _CODECS[name] = codec
    return codec


def unregister(name: str) -> None:
    """Forget the codec registered under ``name`` (tests' toy codecs)."""
    get(name)
    del _CODECS[name]


def get(name: Any) -> KVCodec:
    """The codec registered under ``name``; :class:`UnknownCodec` (a ValueError) if none is."""
    codec = _CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise UnknownCodec(
            f"unknown codec {name!r}; registered codecs: {', '.join(_CODECS)} "
            "(add one with server.cluster.codecs.register)"
        )
    return codec


def names() -> tuple[str, ...]:
    """Registered codec names, in registration order."""
    return tuple(_CODECS)


register(FP32())
register(BF16())
register(Int8())

__all__ = [
    "BF16",
    "FP32",
    "Int8",
    "KVCodec",
    "KVShape",
    "RawCodec",
    "UnknownCodec",
    "get",
    "names",
    "register",
    "unregister",
    "view",
]
