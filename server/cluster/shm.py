"""Same-host transfers: control frames over TCP, payloads through files in ``/dev/shm``.

::

    sender                        /dev/shm (tmpfs)                 receiver
    write askv-<pid>-<token>-<seq> ──▶ file ──▶ copy out, check mac, unlink
    "kv" {..., seq, shm: {name, length, mac}} ───────────────────▶ on_frame(payload inline)
                   ◀───────────────────────────────────────────── "ack" {seq}

Plain files plus ``os.unlink`` rather than ``multiprocessing.shared_memory``: Python 3.11's
resource tracker unlinks (and warns about) segments that the *attaching* process registers,
which breaks a receiver that outlives its sender. At most ``window`` payloads wait in shared
memory per transfer: the back-pressure that ``writer.drain()`` gives over TCP. The receiver
removes each file once copied; the sender removes whatever is left when the transfer ends
(finish, abort, or a receiver failure), so nothing outlives a transfer unless the sending
process dies between writing a file and announcing it. The payload's HMAC (``mac``, bound to
the transfer and ``seq``) travels in the frame's header, which its own tag covers: a file
swapped in ``/dev/shm`` by another local process is refused.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Any

from server.cluster.codec import Frame
from server.cluster.errors import ProtocolError
from server.cluster.tcp import TCPSender

PREFIX = "askv-"
# nothing a peer names may leave the directory
_NAME = re.compile(r"askv-[0-9]+-[0-9a-f]+-([0-9]+|probe)")


def shm_dir() -> Path:
    """Where payload files live: ``/dev/shm`` (RAM) when the host has it, else the temp dir."""
    dev_shm = Path("/dev/shm")
    return dev_shm if dev_shm.is_dir() else Path(tempfile.gettempdir())


def write_payload(path: Path, payload: bytes | bytearray | memoryview) -> int:
    """Create ``path`` (never an existing file or a link) holding ``payload``; returns its size."""
    view = memoryview(payload).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb", buffering=0) as f:
        written = 0
        while written < len(view):
            written += f.write(view[written:])
    return len(view)


def _path(name: object) -> Path:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ProtocolError(f"invalid shared-memory payload name {name!r}")
    return shm_dir() / name


def take_probe(probe: object) -> bool:
    """Remove the sender's probe file; ``False`` if it is not here (another host's sender)."""
    try:
        _path(probe).unlink()
    except FileNotFoundError:
        return False
    return True


def read_payload(name: str, length: int) -> bytearray | None:
    """Copy the payload file ``name`` out of shared memory and remove it; ``None`` when it is
    gone (the sender aborted and withdrew it)."""
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        with open(fd, "rb", buffering=0) as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size != length:
                raise ProtocolError(
                    f"shared-memory payload {path} holds {info.st_size} bytes, "
                    f"the frame announced {length}"
                )
            payload = bytearray(length)
            view, pos = memoryview(payload), 0
            while pos < length:
                n = f.readinto(view[pos:])
                if not n:
                    raise ProtocolError(f"shared-memory payload {path} shrank while being read")
                pos += n
    finally:
        path.unlink(missing_ok=True)
    return payload


class ShmSender(TCPSender):
    """A :class:`TCPSender` whose kv payloads go through shared-memory files."""

    mode = "shm"
    window = 4
    """Payload files in shared memory at once, per transfer (unacknowledged by the receiver)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stem = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}-"
        self._seq = 0
        self._pending: dict[int, Path] = {}
        self._probe = shm_dir() / f"{self._stem}probe"

    def _open_fields(self) -> dict[str, Any]:
        write_payload(self._probe, b"")  # lets the receiver check that it shares our host
        return {"shm_probe": self._probe.name}

    async def _send_kv(self, frame: Frame) -> None:
        await self._wait(lambda: len(self._pending) < self.window, "free a shared-memory slot")
        seq, self._seq = self._seq, self._seq + 1
        name = f"{self._stem}{seq}"
        path = shm_dir() / name
        self._pending[seq] = path
        loop = asyncio.get_running_loop()
        started = loop.time()
        # a copy of megabytes: off the event loop, which may be serving HTTP meanwhile
        length, mac = await asyncio.to_thread(self._put, path, frame.payload, seq)
        self.stats.seconds += loop.time() - started
        self.stats.bytes += length
        await self._write(
            Frame({**frame.header, "seq": seq, "shm": {"name": name, "length": length, "mac": mac}})
        )

    def _put(self, path: Path, payload: bytes | bytearray | memoryview, seq: int) -> tuple[int, str]:
        return write_payload(path, payload), self._out.payload_mac(payload, seq)

    def _on_ack(self, seq: int) -> None:
        if type(seq) is not int or seq not in self._pending:
            raise ProtocolError(
                f"the receiver at {self.address} acknowledged unknown payload {seq!r}"
            )
        del self._pending[seq]  # the receiver copied the file out and removed it

    def _cleanup(self) -> None:
        self._probe.unlink(missing_ok=True)
        for path in self._pending.values():
            path.unlink(missing_ok=True)
        self._pending.clear()
