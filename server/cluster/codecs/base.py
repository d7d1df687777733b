"""What a KV codec is: a name, whether it is exact for a KV dtype, and its payload sections.

A codec never sees bytes on the wire nor the frame header: :mod:`server.cluster.codec` checks
the chunk, lays the sections out back to back (in the order :meth:`KVCodec.sections` lists
them), hands the codec a ``uint8`` view of each to write (``encode``) or read (``decode``),
and carries the checksum. Tensors are views straight into the payload: casting and packing
happen in one pass.

>>> shape = KVShape(layers=2, heads=2, blocks=2, block_size=4, dim=8)
>>> shape.tokens, shape.full, shape.by_block
(8, (2, 2, 8, 8), (2, 2, 2, 4, 8))
>>> import torch
>>> view(torch.zeros(16, dtype=torch.uint8), torch.float32, (2, 2)).shape
torch.Size([2, 2])
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class KVShape:
    """Shape of one chunk: ``blocks`` whole blocks of ``block_size`` tokens, every layer."""

    layers: int
    heads: int
    blocks: int
    block_size: int
    dim: int

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def full(self) -> tuple[int, int, int, int]:
        """K's (and V's) shape: ``[layers, kv_heads, tokens, head_dim]``."""
        return (self.layers, self.heads, self.tokens, self.dim)

    @property
    def by_block(self) -> tuple[int, int, int, int, int]:
        """The same tensor with its tokens split into blocks: ``[L, H, blocks, block_size, D]``."""
        return (self.layers, self.heads, self.blocks, self.block_size, self.dim)

    @property
    def values(self) -> int:
        """Elements of K (or of V)."""
        return self.layers * self.heads * self.tokens * self.dim


class KVCodec(Protocol):
    """One KV payload encoding. Register an instance with :func:`server.cluster.codecs.register`.

    Contract: ``decode(encode(k, v))`` has K's and V's shape; a codec that is exact for a
    source dtype (``is_lossy`` False) gives back the same values. A lossy codec must quantise
    each block on its own: a block's decoded values may not depend on which other blocks
    shared its frame, since moved blocks are keyed (in the family's lossy namespace, under
    ``name``) block by block.
    """

    @property
    def name(self) -> str:
        """The codec's name: the CLI's ``--transfer-codec``, the ``codec`` of every ``open`` and
        ``kv`` header, and the lossy namespace's codec. Lowercase letters, digits, ``. _ -``
        (a class attribute will do)."""
        ...

    def is_lossy(self, source: torch.dtype) -> bool:
        """Whether KV of dtype ``source`` can come back different."""
        ...

    def sections(self, shape: KVShape) -> dict[str, int]:
        """Payload sections as ``{name: bytes}``, in payload order."""
        ...

    def encode(
        self, k: torch.Tensor, v: torch.Tensor, shape: KVShape, out: Mapping[str, torch.Tensor]
    ) -> None:
        """Write ``k`` and ``v`` (CPU, floating, ``shape.full``) into the uint8 sections ``out``."""
        ...

    def decode(
        self, sections: Mapping[str, torch.Tensor], shape: KVShape, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``shape.full`` in ``dtype`` from the ``uint8`` sections, owning their memory
        (never views of the payload)."""
        ...


def view(section: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A ``uint8`` section seen as a ``dtype`` tensor of ``shape`` (no copy)."""
    return section.view(dtype).view(shape)
