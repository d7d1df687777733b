"""Compute dtype and thread budget of an engine process (docs/design.md §4).

bf16 where the hardware computes it natively (a CUDA device, or a CPU with AMX or AVX512-BF16:
bf16 prefill ran ~3x faster than fp32 there), fp32 otherwise. Parity tests pin fp32.

>>> resolve_dtype("float32")
torch.float32
>>> resolve_dtype("auto") in (torch.bfloat16, torch.float32)
True
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@cache
def cpu_has_native_bf16() -> bool:
    """True if the CPU advertises AMX-BF16 or AVX512-BF16 (Linux /proc/cpuinfo)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """``"auto"`` picks bf16 where it is native, else fp32; names and dtypes pass through."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        native = torch.device(device).type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    try:
        return _NAMES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32 or bfloat16") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def set_threads(threads: int | None) -> int:
    """Give this process its share of cores. Several torch processes on one box must each be
    told, or they oversubscribe the cores and every timing lies."""
    if threads is not None:
        if threads <= 0:
            raise ValueError("threads must be positive")
        torch.set_num_threads(threads)
    return torch.get_num_threads()
