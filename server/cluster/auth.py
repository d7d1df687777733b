"""The cluster secret: what router, workers and KV transfers prove to each other, and the
router's admin key.

::

    launcher ── secrets.token_hex(32) ── env AGENTSHARE_CLUSTER_SECRET ──▶ each worker it starts
    another host: --cluster-secret-file PATH (mode 0600, the same text on every host)

    ClusterSecret ─┬─ http_token()  X-Agentshare-Cluster on every /internal/... call
                   │                (router -> worker, and worker -> router when joining)
                   └─ kv_key()      HMAC-SHA256 key of every KV frame (wire.Seal)

The two are derived from the secret with HMAC under distinct labels, so neither reveals the
other or the secret. The secret never goes on a command line (``ps`` shows those). The
router's ``/internal/cluster`` takes an admin key instead (``Authorization: Bearer``), from
``--admin-key-file`` or ``AGENTSHARE_ADMIN_KEY``: it is readable by no one without it.

>>> s = ClusterSecret("x" * 32)
>>> s.check(s.http_token()), s.check("forged"), s.check(None)
(True, False, False)
>>> "x" * 8 in repr(s)
False
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import MutableMapping
from pathlib import Path

SECRET_ENV = "AGENTSHARE_CLUSTER_SECRET"
ADMIN_KEY_ENV = "AGENTSHARE_ADMIN_KEY"
HEADER = "X-Agentshare-Cluster"
MIN_LENGTH = 32


class ClusterSecret:
    """A shared secret of at least 32 characters (the launcher makes 64 hex digits)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        value = value.strip()
        if len(value) < MIN_LENGTH:
            raise ValueError(f"a cluster secret needs at least {MIN_LENGTH} characters, got {len(value)}: "
                             "make one with `agentshare cluster-secret PATH`")
        self._value = value.encode()

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_hex(32))

    @classmethod
    def from_file(cls, path: Path) -> ClusterSecret:
        """Read a secret file; refuse one that others may read (as ssh does a key)."""
        return cls(read_private(path, "cluster secret"))

    @classmethod
    def load(
        cls, path: Path | None = None, *, environ: MutableMapping[str, str] | None = None
    ) -> ClusterSecret | None:
        """From ``path`` if given, else from ``AGENTSHARE_CLUSTER_SECRET`` (taken out of the
        environment, so that no child process inherits it); ``None`` when neither is set."""
        if path is not None:
            return cls.from_file(path)
        env: MutableMapping[str, str] = os.environ if environ is None else environ
        value = env.pop(SECRET_ENV, None)
        return None if value is None else cls(value)

    def write(self, path: Path) -> None:
        """Write the secret to a new file of mode 0600 (never over an existing one)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with open(fd, "w") as f:
            f.write(self._value.decode() + "\n")

    def env(self) -> dict[str, str]:
        """The environment entry that hands the secret to a worker process."""
        return {SECRET_ENV: self._value.decode()}

    def _derive(self, label: bytes) -> bytes:
        return hmac.new(self._value, b"agentshare cluster\x00" + label, hashlib.sha256).digest()

    def kv_key(self) -> bytes:
        """HMAC key of KV frames."""
        return self._derive(b"kv frames v1")

    def http_token(self) -> str:
        """The value of the ``X-Agentshare-Cluster`` header on internal calls."""
        return self._derive(b"internal http v1").hex()

    def headers(self) -> dict[str, str]:
        return {HEADER: self.http_token()}

    def check(self, token: str | None) -> bool:
        """Whether ``token`` (a header's value) is this cluster's, compared in constant time."""
        return token is not None and hmac.compare_digest(token.encode(), self.http_token().encode())

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"


def load_admin_key(path: Path | None = None) -> str | None:
    """The router's admin key: the file's text (mode 0600), else ``AGENTSHARE_ADMIN_KEY``."""
    if path is not None:
        key = read_private(path, "admin key").strip()
    else:
        key = os.environ.pop(ADMIN_KEY_ENV, "").strip()
    return key or None


def check_admin(configured: str | None, authorization: str | None) -> str | None:
    """``None`` if ``authorization`` carries the admin key, else why not.

    >>> check_admin("k" * 32, "Bearer " + "k" * 32) is None, check_admin(None, "Bearer x")[:16]
    (True, 'no admin key is ')
    """
    if configured is None:
        return (f"no admin key is configured on this router: start it with --admin-key-file PATH or "
                f"{ADMIN_KEY_ENV} to read this endpoint")
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), configured.encode()):
        return "this endpoint needs the router's admin key: send 'Authorization: Bearer <admin key>'"
    return None


def read_private(path: Path, what: str) -> str:
    """The text of a file only its owner may read (mode 0600 or stricter)."""
    try:
        info = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from exc
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"the {what} file {path} is readable by others (mode "
                         f"{stat.S_IMODE(info.st_mode):o}): run `chmod 600 {path}`")
    return text
