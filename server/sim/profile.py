"""Service profiles: how fast a worker prefills and decodes, and how big its KV is, as numbers.

The simulator has no model; every time it charges comes from a :class:`ServiceProfile`:

- prefill: ``tokens / prefill_tok_s`` (compute-bound; attention's quadratic term is ignored);
- one decode step of a batch of ``b``: linear in ``b`` through the measured points
  ``decode_tok_s = ((b1, tok/s), (b2, tok/s))`` (step time ``b / tok_s``), extrapolated beyond;
- KV bytes per token from the model config: ``2 (K and V) * layers * kv_heads * head_dim * bytes``.

Two profiles ship:

``CPU_SMOLLM2_135M`` -- docs/design.md §5, measured on this 2-core AVX-512/AMX box: SmolLM2-135M bf16
prefill ~2,000 tok/s; decode 20 tok/s at batch 1 and 60 tok/s at batch 4 (midpoints of 18-22
and 54-67); KV 30 layers x 3 KV heads x 64 dims x 2 (K,V) x 2 bytes = 23,040 B/token
(45 MiB per 2,048 tokens); 4 GiB of KV memory per worker (of 24 GiB).

``GPU_LLAMA8B_H100`` -- not measured here; stated assumptions for an 8B dense model (Llama-3.1-8B:
32 layers, 8 KV heads, head_dim 128, bf16 -> 131,072 B/token) on one 80 GB H100-class GPU:
prefill 20,000 tok/s (16 GFLOP/token at ~40 % of ~800 dense bf16 TFLOP/s); decode step 8 ms at
batch 1 (16 GB of weights at ~2 TB/s effective) growing to 24 ms at batch 64 (KV reads and
compute), i.e. 125 and ~2,670 tok/s; 50 GiB of KV memory (80 GB - weights - activations).

``GPU_LLAMA8B_H20`` -- the decode side of Prefill-as-a-Service's heterogeneous setup (assumed):
a bandwidth-rich, compute-poor GPU (H20-class: ~148 dense bf16 TFLOP/s, 4 TB/s, 96 GB) whose
local prefill runs at 3,000 tok/s (the same 40 % utilisation) and whose decode step is 7 ms at
batch 1 and 20 ms at batch 64; 70 GiB of KV memory.
"""

from __future__ import annotations

from dataclasses import dataclass


def kv_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV bytes one token occupies: K and V for every layer.

    >>> kv_bytes_per_token(layers=30, kv_heads=3, head_dim=64, dtype_bytes=2) * 2048 / 2**20
    45.0
    """
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceProfile:
    """Service rates of one kind of worker.

    >>> p = ServiceProfile(name="t", prefill_tok_s=1000, decode_tok_s=((1, 20.0), (4, 60.0)),
    ...                    kv_bytes_per_token=100, kv_capacity_bytes=10**6)
    >>> p.prefill_seconds(500), round(p.decode_step_seconds(1), 4), round(p.decode_step_seconds(4), 4)
    (0.5, 0.05, 0.0667)
    """

    name: str
    prefill_tok_s: float
    decode_tok_s: tuple[tuple[int, float], tuple[int, float]]
    """Two measured points ``(batch, output tokens/s of the whole batch)``, batches distinct."""
    kv_bytes_per_token: int
    kv_capacity_bytes: int
    prefill_chunk_tokens: int = 512
    """Chunk of a local prefill mixed into one decode iteration on a decode worker."""
    layers: int = 1
    """Layers the KV of one prefill is shipped in (layer-wise pipelining over the link)."""

    def __post_init__(self) -> None:
        (b1, r1), (b2, r2) = self.decode_tok_s
        if self.prefill_tok_s <= 0 or r1 <= 0 or r2 <= 0 or b1 < 1 or b2 <= b1:
            raise ValueError("rates must be positive and decode points at batches b1 < b2")
        if self.kv_bytes_per_token <= 0 or self.kv_capacity_bytes <= 0:
            raise ValueError("KV sizes must be positive")
        if self.prefill_chunk_tokens < 1 or self.layers < 1:
            raise ValueError("prefill_chunk_tokens and layers must be >= 1")

    def prefill_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tok_s

    def decode_step_seconds(self, batch: int) -> float:
        """One decode iteration of ``batch`` requests (each emits one token)."""
        if batch < 1:
            return 0.0
        (b1, r1), (b2, r2) = self.decode_tok_s
        s1, s2 = b1 / r1, b2 / r2
        return s1 + (s2 - s1) * (batch - b1) / (b2 - b1)

    def capacity_tokens(self) -> int:
        return self.kv_capacity_bytes // self.kv_bytes_per_token

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token


CPU_SMOLLM2_135M = ServiceProfile(
    name="cpu-smollm2-135m-bf16",
    prefill_tok_s=2000.0,
    decode_tok_s=((1, 20.0), (4, 60.0)),
    kv_bytes_per_token=kv_bytes_per_token(layers=30, kv_heads=3, head_dim=64, dtype_bytes=2),
    kv_capacity_bytes=4 * 2**30,
    prefill_chunk_tokens=512,
    layers=30,
)

GPU_LLAMA8B_H100 = ServiceProfile(
    name="gpu-llama8b-h100-bf16 (assumed)",
    prefill_tok_s=20_000.0,
    decode_tok_s=((1, 125.0), (64, 64 / 0.024)),
    kv_bytes_per_token=kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2),
    kv_capacity_bytes=50 * 2**30,
    prefill_chunk_tokens=2048,
    layers=32,
)

GPU_LLAMA8B_H20 = ServiceProfile(
    name="gpu-llama8b-h20-bf16 (assumed)",
    prefill_tok_s=3_000.0,
    decode_tok_s=((1, 1 / 0.007), (64, 64 / 0.020)),
    kv_bytes_per_token=kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2),
    kv_capacity_bytes=70 * 2**30,
    prefill_chunk_tokens=2048,
    layers=32,
)
