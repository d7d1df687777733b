"""``agentshare serve`` starts the real server in its own process."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoModelForCausalLM

from agentshare.local_server import free_port
from server.cluster.auth import ClusterSecret
from server.engine.elementwise import KernelSpec
from server.engine.forward import LlamaForward


def test_serve_command(tiny_model_dir: Path, agent_dirs: dict[str, Path], tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
           "--dtype", "float32", "--threads", "1", "--kv-cache", "8MiB", "--module", f"coder={agent_dirs['coder']}",
           "--api-key", "k1", "--log-level", "info"]
    # the fused kernels on, their build held by "another builder" (this test holds its lock): the
    # server logs that it awaits them, starts no builder of its own, and serves eagerly
    kernels = tmp_path / "cache" / "kernels"  # the machine's cache is AGENTSHARE_CACHE_DIR
    spec = KernelSpec.of(LlamaForward.from_hf(AutoModelForCausalLM.from_pretrained(tiny_model_dir)).weights)
    (kernels / spec.key()).mkdir(parents=True)
    lock = open(kernels / spec.key() / "build.lock", "a")
    fcntl.flock(lock, fcntl.LOCK_EX)
    env = {**os.environ, "AGENTSHARE_CACHE_DIR": str(tmp_path / "cache"), "AGENTSHARE_FUSED": "auto"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k1"}).json()
        assert sorted(m["id"] for m in models["data"]) == ["base", "coder"]
        r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer k1"}, timeout=60,
                       json={"model": "coder", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2})
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        lock.close()
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(r.get("event") == "request" and r.get("endpoint") == "/v1/chat/completions" for r in records), err
    engine = next(r for r in records if r.get("event") == "engine")  # what the server chose, logged at start
    assert (engine["threads"], engine["threads_from"]) == (1, "option")
    assert engine["physical_cores"] >= 1 and engine["dtype"] == "torch.float32" and engine["linears"] == "torch"
    assert engine["decode_attention"] == "cascade"  # fp32: vLLM's decode kernel serves bf16 only
    assert engine["decode_elementwise"] == "torch"  # and so do its elementwise ops
    assert engine["malloc_keeps_freed"] is sys.platform.startswith("linux")
    assert (engine["device"], engine["device_from"]) == ("cpu", "auto")  # no CUDA device here
    assert engine["cpu"] and engine["cpu_bf16"] in ("amx", "avx512_bf16", "none")
    assert 0 < engine["kv_pool_bytes"] <= 8 << 20 and engine["kv_blocks"] > 0  # --kv-cache 8MiB
    assert engine["fused_kernels"] == "building"
    fused = next(r for r in records if r.get("event") == "fused_kernels")
    assert (fused["state"], fused["key"], fused["builder"]) == ("building", spec.key(), None)
    assert not any("hello there" in line for line in err.splitlines())


def _usage_error(*args: str) -> str:
    """Run the CLI expecting a usage error before anything loads; its stderr."""
    proc = subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", proc.stderr).split())  # typer's box, unwrapped


def test_a_device_this_process_cannot_use_is_a_usage_error(tmp_path: Path) -> None:
    for command in (["serve"], ["worker", "--role", "decode"]):
        err = _usage_error(*command, "--device", "cuda")
        assert "torch sees no CUDA device" in err and "--device" in err, err
    assert "is not one of auto, cpu, cuda, cuda:N" in _usage_error("serve", "--device", "gpu0")
    err = _usage_error("finetune", str(tmp_path / "d.jsonl"), "-o", str(tmp_path / "m"), "--name", "m",
                       "--device", "cuda:1")
    assert err.startswith("agentshare finetune: device 'cuda:1': torch sees no CUDA device"), err


def test_devices_per_role_need_the_disaggregated_server() -> None:
    assert "need --disaggregated" in _usage_error("serve", "--device", "cpu", "--decode-devices", "1")
    err = _usage_error("serve", "--device", "cpu", "--disaggregated", "--decode-devices", "1,gpu")
    assert "--decode-devices takes CUDA device indices" in err, err


def test_a_prefill_workers_hidden_layers_are_layer_numbers() -> None:
    err = _usage_error("worker", "--role", "prefill", "--device", "cpu", "--keep-hidden-layers", "8,top")
    assert "--keep-hidden-layers takes layer numbers like 8,15, got '8,top'" in err, err


def _refused(*args: str) -> str:
    """Run the CLI expecting it to refuse a model or module it was given; its stderr."""
    proc = subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and not re.search(r"[│╭╮╰╯]", proc.stderr), proc.stderr[-2000:]
    return proc.stderr


def test_a_model_or_module_that_cannot_be_served_is_one_line_naming_it_not_a_traceback(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """The whole path on one line (a launcher shows the server's last lines: the SDK's
    ServerStartError), what to do, exit status 2; for the server and for a worker."""
    missing = tmp_path / ("a-directory-whose-name-is-long-enough-that-a-terminal-would-wrap-it-" * 2) / "model"
    for command in (["serve"], ["worker", "--role", "decode", "--cluster-secret-file", str(_secret_file(tmp_path))]):
        err = _refused(*command, "--model", str(missing), "--dtype", "float32", "--device", "cpu")
        line = next(ln for ln in err.splitlines() if ln.startswith(f"agentshare {command[0]}: "))
        assert f"{missing} is not a model directory (no config.json)" in line, err
        assert "--model takes a base model directory or a base patch" in line, err
    bad = tmp_path / "bad-module"
    bad.mkdir()
    (bad / "agentshare-module.json").write_text("{}")
    err = _refused("serve", "--model", str(tiny_model_dir), "--module", f"coder={bad}", "--dtype", "float32",
                   "--device", "cpu", "--port", str(free_port()))
    line = next(ln for ln in err.splitlines() if ln.startswith("agentshare serve: "))
    assert f"module 'coder': {bad}" in line and "--module takes NAME=PATH" in line, err
    shipped = Path(__file__).resolve().parents[3] / "examples" / "modules" / "coding"  # trained on the team base
    err = _refused("serve", "--model", str(tiny_model_dir), "--module", f"coder={shipped}", "--dtype", "float32",
                   "--device", "cpu", "--port", str(free_port()))
    line = next(ln for ln in err.splitlines() if ln.startswith("agentshare serve: "))
    assert "module 'coder': a LoRA adapter for another base model" in line, err
    assert "--model set to the base it was trained on" in line, err


def _secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.secret"
    ClusterSecret.generate().write(path)
    return path
