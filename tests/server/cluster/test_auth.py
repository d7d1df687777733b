"""The cluster secret and the admin key: where they come from, what is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.cluster.auth import SECRET_ENV, ClusterSecret, check_admin, load_admin_key

ROOT = Path(__file__).resolve().parents[3]


def test_a_secret_file_round_trips_and_only_its_owner_may_read_it(tmp_path: Path):
    path = tmp_path / "cluster.secret"
    made = ClusterSecret.generate()
    made.write(path)
    assert path.stat().st_mode & 0o777 == 0o600
    read = ClusterSecret.from_file(path)
    assert read.http_token() == made.http_token() and read.kv_key() == made.kv_key()
    with pytest.raises(FileExistsError):
        made.write(path)  # never over an existing one
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"readable by others.*chmod 600"):
        ClusterSecret.from_file(path)
    with pytest.raises(ValueError, match="cannot read"):
        ClusterSecret.from_file(tmp_path / "missing")


def test_derived_keys_differ_from_each_other_and_between_secrets():
    a, b = ClusterSecret("a" * 32), ClusterSecret("b" * 32)
    assert a.http_token() != b.http_token() and a.kv_key() != b.kv_key()
    assert a.kv_key().hex() != a.http_token()
    assert not a.check(b.http_token()) and not a.check("") and a.check(a.http_token())
    with pytest.raises(ValueError, match="at least 32 characters"):
        ClusterSecret("short")


def test_the_environment_hands_the_secret_over_once():
    env = {SECRET_ENV: "s" * 40}
    secret = ClusterSecret.load(environ=env)
    assert secret is not None and secret.check(ClusterSecret("s" * 40).http_token())
    assert SECRET_ENV not in env  # children of the worker do not inherit it
    assert ClusterSecret.load(environ={}) is None


def test_the_admin_key_is_checked_in_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    key = "k" * 40
    assert check_admin(key, f"Bearer {key}") is None
    for header in (None, "", key, f"Basic {key}", f"Bearer {key[:-1]}", f"Bearer {key}x"):
        assert "admin key" in (check_admin(key, header) or "")
    assert "no admin key is configured" in (check_admin(None, f"Bearer {key}") or "")
    path = tmp_path / "admin.key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    assert load_admin_key(path) == key
    monkeypatch.setenv("AGENTSHARE_ADMIN_KEY", "from-env")
    assert load_admin_key() == "from-env" and "AGENTSHARE_ADMIN_KEY" not in os.environ


def test_a_worker_without_the_secret_does_not_start():
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    r = subprocess.run([sys.executable, "-m", "server.cli", "worker", "--role", "decode"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "cluster-secret-file" in r.stderr and "agentshare cluster-secret" in " ".join(r.stderr.split())
