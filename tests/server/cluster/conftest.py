"""Fixtures of the cluster tests: real worker and router processes on loopback, tiny model, fp32,
one thread each.

``cluster`` is one disaggregated set for the whole session (a launch costs about 25 s here):
one prefill worker and two decode workers, a cluster secret made by the launcher, two API keys
(two tenants) and an admin key. Every test leaves it as it found it (workers up, no fault) and
uses prompts of its own (``fresh``), so no test depends on another having run.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentshare.local_server import free_port
from server.api.config import ServerConfig
from server.cluster.auth import ADMIN_KEY_ENV
from server.cluster.launch import LocalCluster, WorkerSpec
from server.engine.build import load_engine
from server.engine.core import EngineConfig
from tests.server.helpers import running_server

AGENTS = ("coder", "planner")
API_KEYS = ("tenant-a-key-0123456789", "tenant-b-key-9876543210")  # two tenants
ADMIN_KEY = "admin-key-of-the-test-router-0123456789"


def bearer(key: str = API_KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def fresh(text: str) -> str:
    """``text`` behind a prefix no other request has sent: nothing of it is cached anywhere."""
    return f"[{uuid.uuid4().hex}] {text}"


@dataclass
class Running:
    """A started cluster: the router's URL, the workers (index order of the specs), their logs."""

    url: str
    workers: LocalCluster
    log_dir: Path

    @property
    def internal(self) -> dict[str, str]:
        """Headers of an internal call (the cluster secret's token)."""
        return self.workers.secret.headers()

    def stats(self) -> list[dict[str, Any]]:
        """Each worker's own counters, read from the worker itself."""
        return [httpx.get(f"{u}/internal/stats", headers=self.internal, timeout=10).json() for u in self.workers.urls]

    def cluster(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/internal/cluster", headers=bearer(ADMIN_KEY), timeout=10).json()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.log_dir.glob("*.log")))


@pytest.fixture(scope="session")
def agent_modules(make_lora: Callable[..., Path]) -> dict[str, Path]:
    return {name: make_lora(name, seed=i + 1) for i, name in enumerate(AGENTS)}


@pytest.fixture(scope="session")
def worker_config(tiny_model_dir: Path) -> ServerConfig:
    return ServerConfig(model_dir=tiny_model_dir, dtype="float32", kv_cache_bytes=24 << 20, max_step_tokens=64,
                        log_level="warning", default_max_tokens=16, api_keys=API_KEYS)


@pytest.fixture(scope="session")
def colocated(tiny_model_dir: Path, agent_modules: dict[str, Path], worker_config: ServerConfig) -> Iterator[str]:
    """The same agents served by one colocated server (same API keys): the reference outputs."""
    core = load_engine(tiny_model_dir, modules=agent_modules, dtype="float32", config=EngineConfig())
    with running_server(core, worker_config) as url:
        yield url


@pytest.fixture(scope="session")
def cluster(agent_modules, worker_config, tmp_path_factory) -> Iterator[Running]:
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    with start_cluster(specs_1p2d(agent_modules), worker_config, log_dir,
                       # every prefill over 64 new tokens is offloaded: with bandwidth-aware placement,
                       # whether one is depends on link rates measured by whichever tests ran before
                       # (a few tiny transfers make the link look slow), and the tests would depend on
                       # their order; the bandwidth rule has its own tests (tests/server/policy)
                       router_args=("--offload-threshold", "64", "--transfer-codec", "fp32",
                                    "--no-bandwidth-aware")) as running:
        try:
            yield running
        except BaseException:
            print(running.logs())
            raise


@pytest.fixture
def fault_cluster(cluster: Running) -> Running:
    """The session's cluster, for a test that kills and restarts its workers in real time: such a
    test is in the ``faults`` tier (conftest.py's ``tier_of``), and leaves every worker up again."""
    return cluster


@contextlib.contextmanager
def start_cluster(
    specs: list[WorkerSpec], config: ServerConfig, log_dir: Path, *, router_args: tuple[str, ...] = (),
    chunk_blocks: int = 2,
) -> Iterator[Running]:
    """Workers from ``specs`` (the launcher makes the cluster secret) and a router process over
    them, given the secret, the API keys of ``config`` and ``ADMIN_KEY`` through its environment
    (never its command line); all stopped on exit."""
    with LocalCluster(specs, config, chunk_blocks=chunk_blocks, log_dir=log_dir) as workers:
        port = free_port()
        args = [sys.executable, "-m", "server.cli", "router", "--port", str(port), "--model", str(config.model_dir),
                "--log-level", "warning", *router_args]
        for u in workers.urls:
            args += ["--worker", u]
        env = {**os.environ, **workers.secret.env(), ADMIN_KEY_ENV: ADMIN_KEY,
               "AGENTSHARE_API_KEYS": " ".join(config.api_keys)}
        with open(log_dir / "router.log", "ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
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
