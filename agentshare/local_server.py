"""A local agentshare server in a child process: the SDK's embedded default.

``AsyncClient()`` with no URL starts one on a free loopback port, waits for ``/health``, and
stops it on ``aclose()``. The child never outlives its parent: it is stopped at interpreter
exit, and on Linux the kernel sends it SIGTERM if the parent dies without cleaning up.

>>> server = LocalServer(["--model", str(model_dir), "--dtype", "float32"])   # `agentshare serve` options
>>> await server.start()
>>> server.url                                             # doctest: +ELLIPSIS
'http://127.0.0.1:...'
>>> await server.stop()
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import anyio
import httpx

from agentshare.errors import ServerStartError

_live: weakref.WeakSet[LocalServer] = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    for server in list(_live):
        server.kill()


atexit.register(_stop_all_at_exit)


# free_port and die_with_parent: the server has its own (server.process); the SDK imports nothing from it


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


class LocalServer:
    """``agentshare serve`` as a child process bound to 127.0.0.1."""

    def __init__(self, args: Sequence[str] = (), *, startup_timeout: float = 180.0,
                 python: str = sys.executable) -> None:
        self.args, self.startup_timeout, self.python = list(args), startup_timeout, python
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    async def start(self) -> None:
        """Launch and wait until healthy; raise :class:`ServerStartError` with the log tail if not."""
        if importlib.util.find_spec("server.api") is None:
            raise ServerStartError(
                "the local server needs the server extra: pip install 'agentshare[server]' "
                "(or pass base_url= to connect to a running server)"
            )
        fd, log = tempfile.mkstemp(prefix="agentshare-server-", suffix=".log")
        self.log_path = Path(log)
        cmd = [self.python, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        with os.fdopen(fd, "wb") as out:
            # Popen returns at once (fork + exec); preexec_fn only sets PR_SET_PDEATHSIG in the child
            self.process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
            )
        _live.add(self)
        deadline = time.monotonic() + self.startup_timeout
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise ServerStartError(f"the local server exited with code {code} during start-up",
                                           self.log_tail())
                try:
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.kill()
                    raise ServerStartError(
                        f"the local server did not become healthy within {self.startup_timeout:.0f} s", tail
                    )
                await anyio.sleep(0.2)

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with self.log_path.open(errors="replace") as f:
            return "".join(collections.deque(f, maxlen=lines)).rstrip()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    async def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; waits for the process to go."""
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                await anyio.to_thread.run_sync(proc.wait, timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                await anyio.to_thread.run_sync(proc.wait)
        self._forget()

    def kill(self) -> None:
        """Synchronous, immediate stop (interpreter exit, failed start)."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._forget()

    def _forget(self) -> None:
        _live.discard(self)
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None
