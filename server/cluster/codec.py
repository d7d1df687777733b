"""KV payloads: a run of consecutive blocks, every layer, as one checksummed frame.

Payload sections, back to back, raw little-endian bytes (offsets and lengths in the header)::

    fp32, bf16   K [L, H, T, D] | V [L, H, T, D]                   T = num_blocks * block_size
    int8         K  int8 [L, H, T, D]      | V  int8 [L, H, T, D]
                 | K scales fp16 [L, H, num_blocks, D]   one per block and channel (KIVI's K)
                 | V scales fp16 [L, H, T]               one per token             (KIVI's V)

int8 is quantised *per block*: a block's bytes never depend on which other blocks shared its
frame, so a block that crossed the wire decodes the same whatever the chunking (its key in a
lossy namespace stays meaningful). Quantisation is symmetric round-to-nearest over absmax/127;
scales are stored as float16 rounded *up*, so ``|x - x̂| <= scale/2`` holds with the stored
scale, and an all-zero group has scale 0 and decodes to zeros.

>>> import torch
>>> k = torch.randn(2, 2, 8, 4)          # 2 layers, 2 kv heads, 2 blocks of 4 tokens, head_dim 4
>>> chunk = KVChunk(first_block=0, k=k, v=-k)
>>> frame = encode(chunk, Codec.FP32, block_size=4)
>>> frame.header["num_blocks"], len(frame.payload)
(2, 1024)
>>> back = decode(frame, dtype=torch.float32)
>>> torch.equal(back.k, k) and torch.equal(back.v, -k)
True
>>> len(encode(chunk, Codec.INT8, block_size=4).payload)  # 2*128 codes + 32 K + 32 V fp16 scales
384
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from server.cluster.errors import CorruptPayload, ProtocolError

_FP16_MAX = torch.finfo(torch.float16).max
_INT8_MAX = 127.0
_SHAPE_FIELDS = (
    "first_block",
    "num_blocks",
    "block_size",
    "num_layers",
    "num_kv_heads",
    "head_dim",
)


class Codec(StrEnum):
    """How a KV payload is encoded: raw fp32, raw bf16, or per-block int8 with fp16 scales."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"


_WIRE_DTYPE = {Codec.FP32: torch.float32, Codec.BF16: torch.bfloat16}


def is_lossy(codec: Codec, source: torch.dtype) -> bool:
    """Whether KV of dtype ``source`` can come back different after ``codec``.

    >>> [is_lossy(c, s) for c in Codec for s in (torch.float32, torch.bfloat16)]
    [False, False, True, False, True, True]
    """
    codec = Codec(codec)
    if codec is Codec.INT8:
        return True
    wire = _WIRE_DTYPE[codec]
    # exact iff every value of the source dtype is representable in the wire dtype
    return source != wire and not (
        wire == torch.float32 and source in (torch.bfloat16, torch.float16)
    )


@dataclass(frozen=True, slots=True)
class KVChunk:
    """KV of consecutive blocks of one transfer, every layer."""

    first_block: int
    """Index of the first block within the transferred chain (0-based)."""
    k: torch.Tensor
    """[num_layers, num_kv_heads, num_tokens, head_dim]"""
    v: torch.Tensor
    """Same shape as ``k``; ``num_tokens = num_blocks * block_size``."""

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[2])


@dataclass(frozen=True, slots=True)
class Frame:
    """One unit on the wire: a JSON-safe header and an opaque payload (empty for control frames)."""

    header: dict[str, Any]
    payload: bytes | bytearray | memoryview = b""


def _layout(
    codec: Codec, layers: int, heads: int, blocks: int, block: int, dim: int
) -> dict[str, list[int]]:
    """Payload sections as ``{name: [offset, length]}``, in payload order."""
    tokens = blocks * block
    n = layers * heads * tokens * dim
    if codec is Codec.INT8:
        sizes = {
            "k": n,
            "v": n,
            "k_scale": 2 * layers * heads * blocks * dim,
            "v_scale": 2 * layers * heads * tokens,
        }
    else:
        item = 4 if codec is Codec.FP32 else 2
        sizes = {"k": n * item, "v": n * item}
    sections, offset = {}, 0
    for name, size in sizes.items():
        sections[name] = [offset, size]
        offset += size
    return sections


def _section(
    buf: torch.Tensor, span: list[int], dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    offset, length = span
    return buf[offset : offset + length].view(dtype).view(shape)


def _round_up_fp16(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` in float16, rounded up (so ``|x / s16| <= 127``), clamped to float16's range."""
    s16 = scale.clamp(max=_FP16_MAX).to(torch.float16)
    low = (s16.float() < scale) & (s16 < _FP16_MAX)
    return torch.where(low, torch.nextafter(s16, torch.tensor(torch.inf, dtype=torch.float16)), s16)


def _quantize(x: torch.Tensor, dim: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Symmetric int8 over absmax of ``dim``, written into ``codes`` and ``scales`` (keepdim)."""
    x = x.float()
    scale = x.abs().amax(dim=dim, keepdim=True).div_(_INT8_MAX)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("KV holds non-finite values (inf/NaN); int8 cannot encode them")
    s16 = _round_up_fp16(scale)
    scales.copy_(s16)
    s = s16.float()
    s = torch.where(s == 0, 1.0, s)  # an all-zero group: any divisor gives 0 codes, 0/0 gives NaN
    # clamp: only values beyond float16's max scale saturate
    codes.copy_(torch.div(x, s).round_().clamp_(-_INT8_MAX, _INT8_MAX))


def encode(chunk: KVChunk, codec: Codec, *, block_size: int) -> Frame:
    """Encode ``chunk`` (whole blocks of ``block_size`` tokens) as a ``kv`` frame."""
    codec = Codec(codec)
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
    sections = _layout(codec, layers, heads, blocks, block_size, dim)
    payload = bytearray(sum(length for _, length in sections.values()))
    buf = torch.frombuffer(payload, dtype=torch.uint8)  # torch writes straight into the payload
    k, v = k.cpu(), v.cpu()
    if codec is Codec.INT8:
        by_block = (layers, heads, blocks, block_size, dim)
        _quantize(
            k.reshape(by_block),
            3,
            _section(buf, sections["k"], torch.int8, by_block),
            _section(buf, sections["k_scale"], torch.float16, (layers, heads, blocks, 1, dim)),
        )
        _quantize(
            v,
            3,
            _section(buf, sections["v"], torch.int8, tuple(v.shape)),
            _section(buf, sections["v_scale"], torch.float16, (layers, heads, tokens, 1)),
        )
    else:
        wire = _WIRE_DTYPE[codec]
        _section(buf, sections["k"], wire, tuple(k.shape)).copy_(k)  # casts and packs in one pass
        _section(buf, sections["v"], wire, tuple(v.shape)).copy_(v)
    header: dict[str, Any] = {
        "kind": "kv",
        "first_block": chunk.first_block,
        "num_blocks": blocks,
        "block_size": block_size,
        "num_layers": layers,
        "num_kv_heads": heads,
        "head_dim": dim,
        "codec": codec.value,
        "sections": sections,
        "crc32": zlib.crc32(payload),
    }
    return Frame(header, payload)


def _int_field(header: dict[str, Any], name: str, minimum: int) -> int:
    value = header.get(name)
    if type(value) is not int:  # bool is an int subclass: reject it too
        raise ProtocolError(f"kv header field {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ProtocolError(f"kv header field {name!r} must be >= {minimum}, got {value}")
    return value


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
    name = header.get("codec")
    if name not in tuple(Codec):
        raise ProtocolError(f"unknown codec {name!r}; expected one of {', '.join(Codec)}")
    codec = Codec(name)
    sections = _layout(codec, layers, heads, blocks, block, dim)
    shape = (
        f"{codec} payload of {layers} layers x {heads} kv heads x {blocks}x{block} tokens x {dim}"
    )
    if header.get("sections") != sections:
        raise ProtocolError(
            f"kv header sections {header.get('sections')!r} do not match a {shape}: "
            f"expected {sections}"
        )
    expected = sum(length for _, length in sections.values())
    if len(payload) != expected:
        raise ProtocolError(f"a {shape} has {expected} bytes, the frame carries {len(payload)}")
    if not dtype.is_floating_point:
        raise ValueError(f"decode into a floating dtype, got {dtype}")
    if payload.readonly:  # torch cannot view read-only memory without a warning: copy it once
        payload = memoryview(bytearray(payload))
    buf = torch.frombuffer(payload, dtype=torch.uint8)
    tokens = blocks * block
    full = (layers, heads, tokens, dim)
    if codec is Codec.INT8:
        by_block = (layers, heads, blocks, block, dim)
        k_codes = _section(buf, sections["k"], torch.int8, by_block).float()
        k_scale = _section(buf, sections["k_scale"], torch.float16, (layers, heads, blocks, 1, dim))
        k = k_codes.mul_(k_scale.float()).reshape(full).to(dtype)
        v_codes = _section(buf, sections["v"], torch.int8, full).float()
        v_scale = _section(buf, sections["v_scale"], torch.float16, (layers, heads, tokens, 1))
        v = v_codes.mul_(v_scale.float()).to(dtype)
    else:
        wire = _WIRE_DTYPE[codec]
        k = _section(buf, sections["k"], wire, full).to(dtype, copy=True)  # never alias the payload
        v = _section(buf, sections["v"], wire, full).to(dtype, copy=True)
    return KVChunk(first_block=first, k=k, v=v)
