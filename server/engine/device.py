"""Where an engine process computes, and how much KV fits there (docs/gpu.md).

The device rule, one owner for ``serve``, the cluster's workers, ``finetune`` and the
benchmarks::

    --device auto     the first CUDA device this process sees (CUDA_VISIBLE_DEVICES decides
                      which), else the CPU
    --device cpu
    --device cuda     the same as cuda:0
    --device cuda:N   the N-th device this process sees

The KV pool on a CUDA device is sized from the device's memory, as vLLM's
``gpu_memory_utilization`` sizes its own: the pool may take what is left of ``utilization``
times the device's memory once the weights and everything else already allocated are counted,
less a workspace for one step's activations. On the CPU the pool has the size it is given
(``--kv-cache``, 1 GiB by default).

>>> resolve_device("cpu")
device(type='cpu')
>>> resolve_device("auto", cuda_count=lambda: 0)
device(type='cpu')
>>> resolve_device("cuda:1", cuda_count=lambda: 2)
device(type='cuda', index=1)
>>> kv_pool_bytes(torch.device("cuda", 0), requested=None, utilization=0.9, workspace=2 << 30,
...               memory=lambda d: (60 << 30, 80 << 30)) >> 30          # 72 - 20 used - 2
50
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch

from server.engine.cuda import cuda_count, cuda_memory
from server.kv.errors import KVAllocationError

DEFAULT_CPU_KV_BYTES = 1 << 30
"""The KV pool of a CPU engine when no size is given."""

_SPEC = re.compile(r"(auto|cpu|cuda)(?::(\d+))?")


def resolve_device(spec: str | torch.device | None = "auto", *, cuda_count: Callable[[], int] = cuda_count) -> torch.device:
    """The device ``spec`` names (``auto``, ``cpu``, ``cuda``, ``cuda:N``); a clear error for a
    device this process cannot use.

    >>> resolve_device("tpu")
    Traceback (most recent call last):
    ...
    ValueError: device 'tpu' is not one of auto, cpu, cuda, cuda:N
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    spec = (spec or "auto").strip().lower()
    m = _SPEC.fullmatch(spec)
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ValueError(f"device {spec!r} is not one of auto, cpu, cuda, cuda:N")
    kind, index = m.group(1), int(m.group(2) or 0)
    if kind == "cpu":
        return torch.device("cpu")
    count = cuda_count()
    if kind == "auto":
        return torch.device("cuda", 0) if count else torch.device("cpu")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    if not count:
        raise ValueError(f"device {spec!r}: torch sees no CUDA device{seen} (torch {torch.__version__}, "
                         f"CUDA build: {torch.version.cuda or 'no'}); use --device cpu, or auto")
    if index >= count:
        raise ValueError(f"device {spec!r}: this process sees {count} CUDA device(s), cuda:0 .. cuda:{count - 1}{seen}")
    return torch.device("cuda", index)


def kv_pool_bytes(
    device: torch.device,
    *,
    requested: int | None,
    utilization: float,
    workspace: int,
    memory: Callable[[torch.device], tuple[int, int]] = cuda_memory,
) -> int:
    """Bytes of the KV pool on ``device``.

    ``requested``: the size asked for (``--kv-cache``), or None for the device's share. On a
    CUDA device the share is ``utilization * total - used - workspace``, where ``used`` is what
    the device holds already (weights, other processes) and ``workspace`` what one step's
    activations need; a requested size larger than the free memory less the workspace is refused
    here, with the numbers, rather than failing later inside a step.

    >>> kv_pool_bytes(torch.device("cpu"), requested=None, utilization=0.9, workspace=0)
    1073741824
    >>> kv_pool_bytes(torch.device("cuda", 0), requested=70 << 30, utilization=0.9, workspace=2 << 30,
    ...               memory=lambda d: (60 << 30, 80 << 30))
    Traceback (most recent call last):
    ...
    server.kv.errors.KVAllocationError: a KV pool of 70.0 GiB does not fit on cuda:0: 60.0 GiB free of 80.0 GiB, 2.0 GiB kept for a step's activations; ask for at most 58.0 GiB, or leave --kv-cache at auto
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"the memory utilization must lie in (0, 1], got {utilization}")
    if device.type != "cuda":
        return DEFAULT_CPU_KV_BYTES if requested is None else requested
    free, total = memory(device)
    gib = 1 << 30
    if requested is not None:
        if requested > free - workspace:
            raise KVAllocationError(
                f"a KV pool of {requested / gib:.1f} GiB does not fit on {device}: {free / gib:.1f} GiB free of "
                f"{total / gib:.1f} GiB, {workspace / gib:.1f} GiB kept for a step's activations; ask for at most "
                f"{max(0, free - workspace) / gib:.1f} GiB, or leave --kv-cache at auto")
        return requested
    share = int(utilization * total) - (total - free) - workspace
    if share <= 0:
        raise KVAllocationError(
            f"no room for a KV pool on {device}: {utilization:.0%} of {total / gib:.1f} GiB is "
            f"{utilization * total / gib:.1f} GiB, and {(total - free) / gib:.1f} GiB are in use with "
            f"{workspace / gib:.1f} GiB kept for a step's activations; raise --gpu-memory-utilization or free the device")
    return share


def step_workspace_bytes(*, tokens: int, rows: int, hidden: int, intermediate: int, qkv: int, vocab: int,
                         itemsize: int) -> int:
    """A generous bound on one step's activations: ``tokens`` rows through the widest
    projections (a few live at once) and ``rows`` rows of fp32 logits, twice over for the
    allocator's rounding.

    >>> step_workspace_bytes(tokens=2048, rows=64, hidden=576, intermediate=1536, qkv=960,
    ...                      vocab=49152, itemsize=2) >> 20                     # MiB
    93
    """
    per_token = (4 * hidden + 3 * intermediate + 2 * qkv) * itemsize
    return 2 * (tokens * per_token + rows * vocab * 4)

