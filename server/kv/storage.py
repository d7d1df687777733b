"""KV storage: the torch tensors that hold the blocks the pool hands out.

One K and one V tensor per layer, each laid out head-major over token *slots*::

    k[layer] : [num_kv_heads, num_blocks * block_size, head_dim]
                              └─ block b holds slots [b*B, (b+1)*B)

so a run of consecutive block ids is one strided view (``k[layer][:, s*B:e*B]``) that attention
reads in place — the layout that lets the engine attend over a shared prefix without copying it.

Beside the K/V, a pool that serves layer-split modules keeps the base's hidden state at each
split depth, per slot (``hidden[depth] : [num_blocks * block_size, width]``): a module that
recomputes its top layers over a shared prefix starts from it instead of from the tokens.
The pool (``pool.py``) owns which block holds what; this module only owns memory.

>>> import torch
>>> spec = KVSpec(num_layers=2, num_kv_heads=3, head_dim=64, dtype=torch.float32)
>>> store = KVStorage.from_budget(spec, budget_bytes=1 << 20, block_size=16)
>>> store.num_blocks, store.bytes_per_block
(21, 49152)
>>> store.block_view(0, 5, 3)[0].shape  # K of layer 0, blocks 5..7
torch.Size([3, 48, 64])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.kv.errors import KVAllocationError


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Shape and dtype of a model's KV cache (one family's KV layout)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"KV dimensions must be positive, got {self}")

    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token() * block_size


class KVStorage:
    """Preallocated K/V tensors for ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(
        self, spec: KVSpec, num_blocks: int, block_size: int, device: str | torch.device = "cpu", *,
        hidden_depths: tuple[int, ...] = (), hidden_width: int = 0,
    ) -> None:
        """``hidden_depths``: layers whose input hidden state (``hidden_width`` wide) is kept per
        slot for layer-split modules (empty: none)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if hidden_depths and (hidden_width <= 0 or not all(0 < d < spec.num_layers for d in hidden_depths)):
            raise ValueError(f"hidden depths {hidden_depths} must lie in 1..{spec.num_layers - 1}, "
                             f"with a positive width (got {hidden_width})")
        self.spec = spec
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = self.block_bytes(spec, block_size, hidden_depths, hidden_width)
        shape = (spec.num_kv_heads, num_blocks * block_size, spec.head_dim)
        try:
            self.k = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
            self.v = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
            self.hidden = {d: torch.zeros((num_blocks * block_size, hidden_width), dtype=spec.dtype, device=device)
                           for d in sorted(set(hidden_depths))}
        except (RuntimeError, MemoryError) as exc:  # torch raises RuntimeError/OutOfMemoryError
            raise KVAllocationError(
                f"could not allocate {num_blocks} KV blocks "
                f"({num_blocks * self.bytes_per_block / 2**20:.1f} MiB) on {device}: {exc}; "
                "lower the KV pool size"
            ) from exc

    @staticmethod
    def block_bytes(spec: KVSpec, block_size: int, hidden_depths: tuple[int, ...] = (), hidden_width: int = 0) -> int:
        """Bytes of one block: its K/V, and its hidden states at the split depths."""
        itemsize = torch.empty((), dtype=spec.dtype).element_size()
        return spec.bytes_per_block(block_size) + len(set(hidden_depths)) * hidden_width * itemsize * block_size

    @classmethod
    def from_budget(
        cls, spec: KVSpec, *, budget_bytes: int, block_size: int = 16, device: str | torch.device = "cpu",
        hidden_depths: tuple[int, ...] = (), hidden_width: int = 0,
    ) -> KVStorage:
        """As many blocks as fit in ``budget_bytes`` (hidden states included)."""
        per_block = cls.block_bytes(spec, block_size, hidden_depths, hidden_width)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise KVAllocationError(
                f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                f"({per_block} bytes each); raise the KV pool size"
            )
        return cls(spec, num_blocks, block_size, device, hidden_depths=hidden_depths, hidden_width=hidden_width)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def block_view(self, layer: int, first_block: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of consecutive blocks ``first_block .. first_block+num_blocks-1``."""
        if first_block < 0 or num_blocks < 0 or first_block + num_blocks > self.num_blocks:
            raise IndexError(f"blocks {first_block}..{first_block + num_blocks - 1} out of range")
        s, e = first_block * self.block_size, (first_block + num_blocks) * self.block_size
        return self.k[layer][:, s:e], self.v[layer][:, s:e]

    def slots(self, block_ids: list[int]) -> torch.Tensor:
        """Slot indices of the given blocks, in order (for index_copy/gather of scattered blocks)."""
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        offs = torch.arange(self.block_size, dtype=torch.long)
        return (ids[:, None] * self.block_size + offs[None, :]).reshape(-1)
