"""Raw codecs: K then V as the tensors' bytes in one wire dtype (a cast, no scales).

A raw codec is exact for a source dtype whose every value the wire dtype represents::

    K [L, H, T, D] | V [L, H, T, D]        T = num_blocks * block_size, little-endian

>>> from server.cluster.codecs.fp32 import FP32
>>> from server.cluster.codecs.bf16 import BF16
>>> FP32().is_lossy(torch.bfloat16), BF16().is_lossy(torch.float32), BF16().is_lossy(torch.float16)
(False, True, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from server.cluster.codecs.base import KVShape, view


class RawCodec:
    """Base of a raw codec: a subclass sets ``name`` and ``wire`` (the dtype on the wire)."""

    name: ClassVar[str]
    wire: ClassVar[torch.dtype]

    def is_lossy(self, source: torch.dtype) -> bool:
        # exact iff every value of the source dtype is representable in the wire dtype
        return source != self.wire and not (
            self.wire == torch.float32 and source in (torch.bfloat16, torch.float16)
        )

    def sections(self, shape: KVShape) -> dict[str, int]:
        n = shape.values * self.wire.itemsize
        return {"k": n, "v": n}

    def encode(
        self, k: torch.Tensor, v: torch.Tensor, shape: KVShape, out: Mapping[str, torch.Tensor]
    ) -> None:
        view(out["k"], self.wire, shape.full).copy_(k)  # casts and packs in one pass
        view(out["v"], self.wire, shape.full).copy_(v)

    def decode(
        self, sections: Mapping[str, torch.Tensor], shape: KVShape, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # copies: never alias the payload
        k = view(sections["k"], self.wire, shape.full).to(dtype, copy=True)
        v = view(sections["v"], self.wire, shape.full).to(dtype, copy=True)
        return k, v
