"""The vllm engine's command-line options: wrong combinations are refused with what to do."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.cli import app


def _run(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, " ".join(r.output.split())


def test_node_needs_the_vllm_engine() -> None:
    code, out = _run("serve", "--node", "http://10.0.0.2:8200")
    assert code == 2 and "--node needs --engine vllm" in out


def test_tensor_parallelism_needs_the_vllm_engine() -> None:
    code, out = _run("serve", "--tensor-parallel-size", "2")
    assert code == 2 and "--tensor-parallel-size needs --engine vllm" in out
    code, out = _run("serve", "--engine", "vllm", "--tensor-parallel-size", "0")
    assert code == 2 and "--tensor-parallel-size" in out  # at least one rank


def test_a_plan_the_model_cannot_take_is_a_usage_error(tiny_model_dir: Path, coder_module_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found before any instance starts (the tiny model has 2 KV heads), said as a usage error."""
    import server.cli

    monkeypatch.setattr(server.cli, "_require_vllm", lambda what: None)
    secret = tmp_path / "cluster.secret"
    secret.write_text("s" * 64)
    secret.chmod(0o600)
    common = ["--model", str(tiny_model_dir), "--module", f"coder={coder_module_dir}", "--tensor-parallel-size", "3"]
    for args in (["serve", "--engine", "vllm", *common], ["vllm-node", *common, "--cluster-secret-file", str(secret)]):
        code, out = _run(*args)
        flat = " ".join(out.replace("│", " ").split())  # the error box wraps long lines
        assert code == 2 and "does not divide the model's 2 KV heads" in flat and "use one of 1, 2" in flat, out


def test_a_cluster_secret_that_others_may_read_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "cluster.secret"
    secret.write_text("s" * 64)
    secret.chmod(0o644)
    code, out = _run("serve", "--engine", "vllm", "--node", "http://10.0.0.2:8200", "--cluster-secret-file", str(secret))
    assert code == 2 and "chmod 600" in out
    code, out = _run("serve", "--engine", "vllm", "--node", "http://10.0.0.2:8200")
    assert code == 2 and "--cluster-secret-file" in out  # a node needs the secret


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_both_commands_say_how_to_install_it() -> None:
    for args in (("serve", "--engine", "vllm"), ("vllm-node", "--module", "coder=/m/coder")):
        code, out = _run(*args)
        assert code == 2 and "pip install 'agentshare[vllm]'" in out, args
