"""``int8``: KIVI-style int8 per block, always lossy (its blocks land in the lossy namespace).

Sections, back to back::

    K  int8 [L, H, T, D] | V  int8 [L, H, T, D]
    | K scales fp16 [L, H, num_blocks, D]   one per block and channel (KIVI's K)
    | V scales fp16 [L, H, T]               one per token             (KIVI's V)

Quantised *per block*: a block's bytes never depend on which other blocks shared its frame, so
a block that crossed the wire decodes the same whatever the chunking (its key in a lossy
namespace stays meaningful). Quantisation is symmetric round-to-nearest over absmax/127;
scales are stored as float16 rounded *up*, so ``|x - x̂| <= scale/2`` holds with the stored
scale, and an all-zero group has scale 0 and decodes to zeros.

>>> from server.cluster.codecs.base import KVShape
>>> Int8().sections(KVShape(layers=2, heads=2, blocks=2, block_size=4, dim=4))  # bytes
{'k': 128, 'v': 128, 'k_scale': 64, 'v_scale': 64}
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from server.cluster.codecs.base import KVShape, view

_FP16_MAX = torch.finfo(torch.float16).max
_INT8_MAX = 127.0


class Int8:
    name = "int8"

    def is_lossy(self, source: torch.dtype) -> bool:
        return True

    def sections(self, shape: KVShape) -> dict[str, int]:
        layers, heads = shape.layers, shape.heads
        return {
            "k": shape.values,
            "v": shape.values,
            "k_scale": 2 * layers * heads * shape.blocks * shape.dim,
            "v_scale": 2 * layers * heads * shape.tokens,
        }

    def encode(
        self, k: torch.Tensor, v: torch.Tensor, shape: KVShape, out: Mapping[str, torch.Tensor]
    ) -> None:
        layers, heads, blocks, dim = shape.layers, shape.heads, shape.blocks, shape.dim
        _quantize(
            k.reshape(shape.by_block),
            3,
            view(out["k"], torch.int8, shape.by_block),
            view(out["k_scale"], torch.float16, (layers, heads, blocks, 1, dim)),
        )
        _quantize(
            v,
            3,
            view(out["v"], torch.int8, shape.full),
            view(out["v_scale"], torch.float16, (layers, heads, shape.tokens, 1)),
        )

    def decode(
        self, sections: Mapping[str, torch.Tensor], shape: KVShape, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layers, heads, blocks, dim = shape.layers, shape.heads, shape.blocks, shape.dim
        k_codes = view(sections["k"], torch.int8, shape.by_block).float()
        k_scale = view(sections["k_scale"], torch.float16, (layers, heads, blocks, 1, dim))
        k = k_codes.mul_(k_scale.float()).reshape(shape.full).to(dtype)
        v_codes = view(sections["v"], torch.int8, shape.full).float()
        v_scale = view(sections["v_scale"], torch.float16, (layers, heads, shape.tokens, 1))
        v = v_codes.mul_(v_scale.float()).to(dtype)
        return k, v


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
