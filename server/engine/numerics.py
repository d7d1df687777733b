"""Compute dtype and thread budget of an engine process (docs/design.md §4).

bf16 where the hardware computes it natively (a CUDA device, or a CPU with AMX or AVX512-BF16:
bf16 prefill ran ~3x faster than fp32 there), fp32 otherwise. Parity tests pin fp32.

>>> resolve_dtype("float32")
torch.float32
>>> resolve_dtype("auto") in (torch.bfloat16, torch.float32)
True
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_bf16(cpuinfo: str | None = None) -> str:
    """The CPU's native bf16 instructions, read from ``cpuinfo`` (default: Linux /proc/cpuinfo):
    ``amx`` (AMX-BF16 tiles: what vLLM's CPU kernels and oneDNN's fastest GEMMs use),
    ``avx512_bf16`` (bf16 dot products in AVX-512 registers only) or ``none``. Logged at start,
    and recorded by the speed benchmarks: the engine's standing beside vLLM differs between the
    first two (docs/engine.md).

    >>> cpu_bf16("flags : avx512f avx512_bf16 amx_bf16 amx_tile"), cpu_bf16("flags : avx512f avx512_bf16")
    ('amx', 'avx512_bf16')
    """
    flags = set((_cpuinfo() if cpuinfo is None else cpuinfo).split())
    return "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "none"


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name, read from ``cpuinfo`` (default: Linux /proc/cpuinfo), else the
    machine's architecture.

    >>> cpu_model("model name : AMD EPYC")
    'AMD EPYC'
    """
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.machine()


@cache
def cpu_has_native_bf16() -> bool:
    """True if the CPU advertises AMX-BF16 or AVX512-BF16."""
    return cpu_bf16() != "none"


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


def physical_cores(cpus: set[int] | None = None) -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads count once).

    Reads the affinity mask and Linux's ``thread_siblings_list``; where those are missing, the
    logical CPUs count.

    >>> physical_cores() >= 1
    True
    """
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores: set[str] = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(f"cpu{cpu}")
    return max(1, len(cores))


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    threads: int
    source: str  # "option", "OMP_NUM_THREADS" or "physical cores"
    physical_cores: int


def choose_threads(threads: int | None, env: Mapping[str, str] | None = None) -> ThreadChoice:
    """The thread budget of an engine process: the ``--threads`` option, else ``OMP_NUM_THREADS``
    (a launcher that shares the cores among processes sets it; read from ``env`` when given, the
    environment of a process about to be started), else the physical cores this process may use
    (hyper-threads slow a memory-bound decode down).

    >>> choose_threads(3).threads, choose_threads(3).source
    (3, 'option')
    """
    cores = physical_cores()
    if threads is not None:
        if threads <= 0:
            raise ValueError("threads must be positive")
        return ThreadChoice(threads, "option", cores)
    given = (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return ThreadChoice(int(given), "OMP_NUM_THREADS", cores)
    return ThreadChoice(cores, "physical cores", cores)


def set_threads(threads: int | None) -> int:
    """Give this process its share of cores (:func:`choose_threads`). Several torch processes on
    one box must each be told, or they oversubscribe the cores and every timing lies."""
    choice = choose_threads(threads)
    torch.set_num_threads(choice.threads)
    return torch.get_num_threads()
