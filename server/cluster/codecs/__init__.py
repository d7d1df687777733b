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

from server.cluster.codecs.base import KVCodec, KVShape, view
from server.cluster.codecs.bf16 import BF16
from server.cluster.codecs.fp32 import FP32
from server.cluster.codecs.int8 import Int8
from server.cluster.codecs.raw import RawCodec
from server.registry import Registry, UnknownName


class UnknownCodec(UnknownName):
    """A codec name that no codec is registered under; the message lists the registered ones."""


CODECS = Registry[KVCodec]("codec", error=UnknownCodec, hint="add one with server.cluster.codecs.register")


def register(codec: KVCodec, *, replace: bool = False) -> KVCodec:
    """Make ``codec`` usable under ``codec.name``; returns it. A taken name needs ``replace``."""
    return CODECS.register(getattr(codec, "name", None), codec, replace=replace)  # type: ignore[arg-type]


get, names, unregister = CODECS.get, CODECS.names, CODECS.unregister


register(FP32())
register(BF16())
register(Int8())

__all__ = [
    "BF16",
    "CODECS",
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
