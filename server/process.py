"""Helpers for the server's child processes (cluster workers, launched routers): a free port to
bind, and a child that dies with its parent.

The SDK keeps its own copies in :mod:`agentshare.local_server`: the SDK installs
light and imports nothing from ``server``.

>>> 0 < free_port() < 65536
True
"""

from __future__ import annotations

import signal
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the caller binds it soon after)."""
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
