"""KV payloads: a run of consecutive blocks, every layer, as one checksummed frame.

The payload is the codec's sections back to back, raw little-endian bytes (offsets and lengths
in the header); the codecs themselves, by name, are in :mod:`server.cluster.codecs`::

    fp32, bf16   K [L, H, T, D] | V [L, H, T, D]                   T = num_blocks * block_size
    int8         K  int8 [L, H, T, D]      | V  int8 [L, H, T, D]
                 | K scales fp16 [L, H, num_blocks, D]   one per block and channel (KIVI's K)
                 | V scales fp16 [L, H, T]               one per token             (KIVI's V)

A chunk may also carry hidden states (the input of the layers where layer-split modules start
recomputing), appended raw after the codec's sections, one ``[T, width]`` section per layer in
ascending order, in their own dtype (header ``hidden``: depths, width, dtype).

This module checks the chunk and the header, lays the sections out, and carries the crc32;
the codec writes and reads the sections. A codec is named by its registered name (a string;
:class:`Codec` spells the built-in ones).

>>> import torch
>>> k = torch.randn(2, 2, 8, 4)          # 2 layers, 2 kv heads, 2 blocks of 4 tokens, head_dim 4
>>> chunk = KVChunk(first_block=0, k=k, v=-k)
>>> frame = encode(chunk, Codec.FP32, block_size=4)
>>> frame.header["num_blocks"], len(frame.payload)
(2, 1024)
>>> back = decode(frame, dtype=torch.float32)
>>> torch.equal(back.k, k) and torch.equal(back.v, -k)
True
>>> len(encode(chunk, "int8", block_size=4).payload)  # 2*128 codes + 32 K + 32 V fp16 scales
384
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from server.cluster import codecs
from server.cluster.codecs import KVCodec, KVShape
from server.cluster.errors import CorruptPayload, ProtocolError

_SHAPE_FIELDS = (
    "first_block",
    "num_blocks",
    "block_size",
    "num_layers",
    "num_kv_heads",
    "head_dim",
)


class Codec(StrEnum):
    """The built-in codecs' names: raw fp32, raw bf16, per-block int8 with fp16 scales.

    A member is its name (a ``str``): anything that takes a codec takes either. A codec added
    to :mod:`server.cluster.codecs` is used by its name and needs no member here.
    """

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"


def is_lossy(codec: str, source: torch.dtype) -> bool:
    """Whether KV of dtype ``source`` can come back different after ``codec``.

    Examples:
        >>> [is_lossy(c, s) for c in Codec for s in (torch.float32, torch.bfloat16)]
        [False, False, True, False, True, True]
    """
    return codecs.get(codec).is_lossy(source)


@dataclass(frozen=True, slots=True)
class KVChunk:
    """KV of consecutive blocks of one transfer, every layer."""

    first_block: int
    """Index of the first block within the transferred chain (0-based)."""
    k: torch.Tensor
    """[num_layers, num_kv_heads, num_tokens, head_dim]"""
    v: torch.Tensor
    """Same shape as ``k``; ``num_tokens = num_blocks * block_size``."""
    wait: Callable[[], None] | None = None
    """Call before reading ``k``/``v``: their copy from a device may still be on its way."""
    hidden: Mapping[int, torch.Tensor] = field(default_factory=dict)
    """Layer -> its input hidden state at these tokens, ``[num_tokens, hidden_size]``: what a
    layer-split module recomputes its top layers from. Sent raw, in its dtype, whatever the
    codec of the K/V."""

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[2])


@dataclass(frozen=True, slots=True)
class Frame:
    """One unit on the wire: a JSON-safe header and an opaque payload (empty for control frames)."""

    header: dict[str, Any]
    payload: bytes | bytearray | memoryview = b""


def _layout(codec: KVCodec, shape: KVShape) -> dict[str, list[int]]:
    """Payload sections as ``{name: [offset, length]}``, in payload order."""
    sections, offset = {}, 0
    for name, size in codec.sections(shape).items():
        sections[name] = [offset, size]
        offset += size
    return sections


def _views(buf: torch.Tensor, sections: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    return {name: buf[offset : offset + length] for name, (offset, length) in sections.items()}


def encode(chunk: KVChunk, codec: str, *, block_size: int) -> Frame:
    """Encode ``chunk`` (whole blocks of ``block_size`` tokens) as a ``kv`` frame of ``codec``
    (a registered name; :class:`~server.cluster.codecs.UnknownCodec` otherwise)."""
    impl = codecs.get(codec)
    if chunk.wait is not None:
        chunk.wait()
    k, v = chunk.k, chunk.v
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            "K and V must both be [layers, kv_heads, tokens, head_dim]; "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if not (k.is_floating_point() and v.is_floating_point()):
        raise ValueError(f"KV must be floating point, got {k.dtype} / {v.dtype}")
    layers, heads, tokens, dim = k.shape
    if block_size <= 0 or tokens == 0 or tokens % block_size:
        raise ValueError(
            f"a chunk holds whole blocks: {tokens} tokens is not a positive multiple of "
            f"block_size {block_size}"
        )
    if chunk.first_block < 0:
        raise ValueError(f"first_block must be >= 0, got {chunk.first_block}")
    assert sys.byteorder == "little", "payloads are little-endian raw tensor bytes"
    blocks = tokens // block_size
    shape = KVShape(layers, heads, blocks, block_size, dim)
    sections = _layout(impl, shape)
    kv_bytes = sum(length for _, length in sections.values())
    hidden = _hidden_header(chunk.hidden, tokens)
    payload = bytearray(kv_bytes + _hidden_bytes(hidden, tokens))
    buf = torch.frombuffer(payload, dtype=torch.uint8)  # torch writes straight into the payload
    impl.encode(k.cpu(), v.cpu(), shape, _views(buf, sections))
    offset = kv_bytes
    for depth in hidden.get("depths", []):
        raw = chunk.hidden[depth].cpu().contiguous().view(torch.uint8).reshape(-1)
        buf[offset : offset + raw.numel()] = raw
        offset += raw.numel()
    header: dict[str, Any] = {
        "kind": "kv",
        "first_block": chunk.first_block,
        "num_blocks": blocks,
        "block_size": block_size,
        "num_layers": layers,
        "num_kv_heads": heads,
        "head_dim": dim,
        "codec": impl.name,
        "sections": sections,
        "crc32": zlib.crc32(payload),
    }
    if hidden:
        header["hidden"] = hidden
    return Frame(header, payload)


_HIDDEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _hidden_header(hidden: Mapping[int, torch.Tensor], tokens: int) -> dict[str, Any]:
    """The ``hidden`` header field of a chunk's hidden states ({} when it carries none)."""
    if not hidden:
        return {}
    depths = sorted(hidden)
    first = hidden[depths[0]]
    dtype = str(first.dtype).removeprefix("torch.")
    if dtype not in _HIDDEN_DTYPES or first.dim() != 2 or first.shape[0] != tokens:
        raise ValueError(f"hidden states must be [{tokens}, width] of {', '.join(_HIDDEN_DTYPES)}; "
                         f"got {tuple(first.shape)} {first.dtype}")
    if any(d < 1 or hidden[d].shape != first.shape or hidden[d].dtype != first.dtype for d in depths):
        raise ValueError("every hidden state needs a layer >= 1 and the same shape and dtype")
    return {"depths": depths, "width": int(first.shape[1]), "dtype": dtype}


def _hidden_bytes(hidden: dict[str, Any], tokens: int) -> int:
    if not hidden:
        return 0
    itemsize = _HIDDEN_DTYPES[hidden["dtype"]].itemsize
    return len(hidden["depths"]) * tokens * hidden["width"] * itemsize


def _check_hidden(header: dict[str, Any], layers: int) -> dict[str, Any]:
    """The frame's ``hidden`` field, checked ({} when absent)."""
    hidden = header.get("hidden")
    if hidden is None:
        return {}
    if not isinstance(hidden, dict) or set(hidden) != {"depths", "width", "dtype"}:
        raise ProtocolError(f"kv header field 'hidden' must hold depths, width and dtype, got {hidden!r}")
    depths, width, dtype = hidden["depths"], hidden["width"], hidden["dtype"]
    if (not isinstance(depths, list) or not depths or any(type(d) is not int for d in depths)
            or depths != sorted(set(depths)) or not 1 <= depths[0] <= depths[-1] < layers):
        raise ProtocolError(f"hidden depths must be distinct ascending layers in 1..{layers - 1}, got {depths!r}")
    if type(width) is not int or width < 1 or dtype not in _HIDDEN_DTYPES:
        raise ProtocolError(f"hidden width must be a positive integer and dtype one of {sorted(_HIDDEN_DTYPES)}, "
                            f"got {width!r} and {dtype!r}")
    return hidden


def _int_field(header: dict[str, Any], name: str, minimum: int) -> int:
    value = header.get(name)
    if type(value) is not int:  # bool is an int subclass: reject it too
        raise ProtocolError(f"kv header field {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ProtocolError(f"kv header field {name!r} must be >= {minimum}, got {value}")
    return value


def codec_of(header: dict[str, Any]) -> KVCodec:
    """The registered codec a frame header names; :class:`ProtocolError` if it names none."""
    try:
        return codecs.get(header.get("codec"))
    except codecs.UnknownCodec as exc:
        raise ProtocolError(str(exc)) from None


def decode(frame: Frame, *, dtype: torch.dtype) -> KVChunk:
    """Verify and decode a ``kv`` frame into contiguous tensors of ``dtype`` that own their memory.

    Raises :class:`CorruptPayload` on a checksum mismatch (checked first) and
    :class:`ProtocolError` on a header that does not describe the payload.
    """
    header, payload = frame.header, memoryview(frame.payload).cast("B")
    if not isinstance(header, dict):
        raise ProtocolError(f"kv header must be a JSON object, got {type(header).__name__}")
    crc = header.get("crc32")
    if type(crc) is not int or not 0 <= crc < 1 << 32:
        raise ProtocolError(
            f"kv header field 'crc32' must be an unsigned 32-bit integer, got {crc!r}"
        )
    actual = zlib.crc32(payload)
    if actual != crc:
        raise CorruptPayload(
            f"KV payload checksum mismatch: header says crc32 {crc:#010x}, the {len(payload)} "
            f"received bytes have {actual:#010x}"
        )
    if header.get("kind") != "kv":
        raise ProtocolError(f"expected a 'kv' frame, got kind {header.get('kind')!r}")
    first, blocks, block, layers, heads, dim = (
        _int_field(header, name, 0 if name == "first_block" else 1) for name in _SHAPE_FIELDS
    )
    impl = codec_of(header)
    shape = KVShape(layers, heads, blocks, block, dim)
    sections = _layout(impl, shape)
    what = (
        f"{impl.name} payload of {layers} layers x {heads} kv heads x {blocks}x{block} tokens x "
        f"{dim}"
    )
    if header.get("sections") != sections:
        raise ProtocolError(
            f"kv header sections {header.get('sections')!r} do not match a {what}: "
            f"expected {sections}"
        )
    kv_bytes = sum(length for _, length in sections.values())
    hidden = _check_hidden(header, layers)
    expected = kv_bytes + _hidden_bytes(hidden, blocks * block)
    if len(payload) != expected:
        raise ProtocolError(f"a {what} has {expected} bytes, the frame carries {len(payload)}")
    if not dtype.is_floating_point:
        raise ValueError(f"decode into a floating dtype, got {dtype}")
    if payload.readonly:  # torch cannot view read-only memory without a warning: copy it once
        payload = memoryview(bytearray(payload))
    buf = torch.frombuffer(payload, dtype=torch.uint8)
    k, v = impl.decode(_views(buf, sections), shape, dtype)
    states, offset, tokens = {}, kv_bytes, blocks * block
    for depth in hidden.get("depths", []):
        n = tokens * hidden["width"] * _HIDDEN_DTYPES[hidden["dtype"]].itemsize
        raw = buf[offset : offset + n].view(_HIDDEN_DTYPES[hidden["dtype"]]).reshape(tokens, hidden["width"])
        states[depth] = raw.to(dtype=dtype, copy=True)
        offset += n
    return KVChunk(first_block=first, k=k, v=v, hidden=states)
