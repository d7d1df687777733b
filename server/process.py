"""Helpers for the server's child processes (cluster workers, launched routers, vLLM instances):
a free port to bind, a child that dies with its parent, and waiting until a child serves.

The SDK keeps its own copies in :mod:`agentshare.local_server`: the SDK installs
light and imports nothing from ``server``.

>>> 0 < free_port() < 65536
True
"""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the caller binds it soon after), drawn below the
    kernel's ephemeral range where there is room: the kernel hands ephemeral ports to every
    outgoing connection and every bind to port 0, so one picked there can be taken before the
    caller binds it (seen: a server that bound its port a minute after choosing it, while vLLM
    started)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(10000, low), min(20, max(0, low - 10000))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, contextlib.suppress(OSError):
            s.bind((host, port))
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """In a child, between fork and exec: get SIGTERM when the parent dies, however it dies
    (Linux), so no orphan keeps a port and its memory."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: atexit still stops it on a normal exit


def wait_ready(proc: subprocess.Popen[bytes], url: str, *, deadline: float, what: str, hint: str = "",
               headers: Mapping[str, str] | None = None, poll: float = 0.2) -> None:
    """Wait until ``url`` answers 200 (a child's health or info endpoint), until ``deadline``
    (``time.monotonic()``); raise, naming ``what`` and ``hint`` (say, its log), if the child exits
    first or the deadline passes."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting{hint}")
        try:
            if httpx.get(url, headers=headers, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} at {url} not ready in time{hint}")
        time.sleep(poll)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the system;
    call it in a serving process before its engine allocates (Linux with glibc; elsewhere a
    no-op that returns False).

    Why: every engine step allocates and frees tens of MiB of activations. By default glibc
    serves such sizes with fresh ``mmap`` pages (or trims the heap they came from), so each step
    page-faults its buffers in again, and an engine thread's own arena does so more than the
    main thread's. Measured here (default model, bf16, 2 threads, the engine on its thread): a
    2,048-token prefill took 0.92–1.54 s by default, 0.78–0.84 s with this. Large allocations
    stay in the heap (no mmap threshold below 1 GiB), the heap is not trimmed below 1 GiB of
    free space, and all threads share one arena (an engine process has one busy thread).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1  # (mallopt takes a C int)
        ok &= libc.mallopt(_M_ARENA_MAX, 1) == 1
        return bool(ok)
    except (OSError, AttributeError):
        return False
