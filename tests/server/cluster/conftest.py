"""Fixtures of the cluster tests: real worker and router processes on loopback, tiny model, fp32,
one thread each."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentshare.local_server import free_port
from server.api.config import ServerConfig
from server.cluster.launch import LocalCluster, WorkerSpec

AGENTS = ("coder", "planner")


@dataclass
class Running:
    """A started cluster: the router's URL, the workers (index order of the specs), their logs."""

    url: str
    workers: LocalCluster
    log_dir: Path

    def stats(self) -> list[dict[str, Any]]:
        """Each worker's own counters, read from the worker itself."""
        return [httpx.get(f"{u}/internal/stats", timeout=10).json() for u in self.workers.urls]

    def cluster(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/internal/cluster", timeout=10).json()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.log_dir.glob("*.log")))


@pytest.fixture(scope="session")
def agent_modules(make_lora: Callable[..., Path]) -> dict[str, Path]:
    return {name: make_lora(name, seed=i + 1) for i, name in enumerate(AGENTS)}


@pytest.fixture(scope="session")
def worker_config(tiny_model_dir: Path) -> ServerConfig:
    return ServerConfig(model_dir=tiny_model_dir, dtype="float32", kv_cache_bytes=24 << 20, max_step_tokens=64,
                        log_level="warning", default_max_tokens=16)


@contextlib.contextmanager
def start_cluster(
    specs: list[WorkerSpec], config: ServerConfig, log_dir: Path, *, router_args: tuple[str, ...] = (),
    chunk_blocks: int = 2,
) -> Iterator[Running]:
    """Workers from ``specs`` and a router process over them; all stopped on exit."""
    with LocalCluster(specs, config, chunk_blocks=chunk_blocks, log_dir=log_dir) as workers:
        port = free_port()
        args = [sys.executable, "-m", "server.cli", "router", "--port", str(port), "--model", str(config.model_dir),
                "--log-level", "warning", *router_args]
        for u in workers.urls:
            args += ["--worker", u]
        with open(log_dir / "router.log", "ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait(url, proc)
            yield Running(url, workers, log_dir)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the router at {url} did not come up")


def specs_1p2d(modules: Mapping[str, Path], *, prefill_env: Mapping[str, str] | None = None) -> list[WorkerSpec]:
    """One prefill worker and two decode workers, an agent on each."""
    return [
        WorkerSpec(role="prefill", env=dict(prefill_env or {})),
        WorkerSpec(role="decode", modules={"coder": modules["coder"]}),
        WorkerSpec(role="decode", modules={"planner": modules["planner"]}),
    ]
