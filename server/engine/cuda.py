"""The calls that only a CUDA device answers: how many devices, their memory and names, copies
to pinned host memory on a side stream, and graph capture (docs/gpu.md).

Kept apart from the rules that use them (``device.py``, ``graphs.py``) so that those rules are
tested everywhere, with stand-ins for these calls. These run in ``tests/cuda`` on a device
(``scripts/device-check``); on a CPU-only machine only their CPU branches run.

>>> cuda_count() >= 0, device_name(torch.device("cpu"))
(True, 'cpu')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def cuda_count() -> int:
    """CUDA devices this process sees (``CUDA_VISIBLE_DEVICES`` decides which)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_memory(device: torch.device) -> tuple[int, int]:
    """Free and total bytes of a CUDA device."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def device_name(device: torch.device) -> str:
    """What to log: the CUDA device's name, or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def to_host(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Callable[[], None] | None]:
    """Host copies of ``tensors``, and what to call before reading them (None: they are ready).

    On a CUDA device the copies go to pinned memory on a side stream, after the work queued so
    far on the current one: the engine's next step runs while they travel, and the reader waits
    for these copies alone. On the CPU the tensors themselves come back.

    >>> (t,), wait = to_host(torch.ones(2))
    >>> t.tolist(), wait is None
    ([1.0, 1.0], True)
    """
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    device = tensors[0].device
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    hosts = []
    with torch.cuda.stream(stream):
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the device memory stays ours until the copy is done
            hosts.append(host)
    done = torch.cuda.Event()
    done.record(stream)
    return tuple(hosts), done.synchronize


def new_graph_pool() -> Any:
    """A memory pool that the graphs of one engine share."""
    return torch.cuda.graph_pool_handle()


def capture_graph(step: Callable[[], torch.Tensor], *, device: torch.device, pool: Any,
                  before: Callable[[], None]) -> tuple[Any, torch.Tensor]:
    """Capture ``step`` as a CUDA graph in ``pool``; the graph and the output it writes.

    ``step`` runs once first on a side stream (a warm-up: whatever it caches is made outside the
    graph), then ``before`` (drop what the graph must compute itself), then the capture. Errors
    are thread-local: other threads may wait on their own copies meanwhile."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    before()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step()
    return graph, out
