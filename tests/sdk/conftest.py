"""Fixtures of the SDK tests: one real server (the tiny model, fp32, with two LoRA agents of its
family) per test module, launched with the SDK's own LocalServer; tests connect by URL. Tests of
auto-launch start their own servers."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agentshare.local_server import LocalServer

HAS_TRIO = importlib.util.find_spec("trio") is not None
LORA_AGENTS = ("coder", "planner")


@pytest.fixture(params=["asyncio", pytest.param("trio", marks=pytest.mark.skipif(not HAS_TRIO, reason="trio not installed"))])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def lora_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random LoRA agents with manifests joining the tiny model's fp32 family."""
    from server.kv.family import family_digest
    from tests.server.api.conftest import make_lora_module

    family = family_digest(tiny_model_dir, kv_dtype="float32")
    return {name: make_lora_module(tiny_model_dir, tmp_path_factory.mktemp(f"sdk-lora-{name}"), name, family,
                                   seed=i + 1)
            for i, name in enumerate(LORA_AGENTS)}


def server_args(model_dir: Path, modules: dict[str, Path] | None = None) -> list[str]:
    args = ["--model", str(model_dir), "--dtype", "float32", "--kv-cache", "64MiB", "--threads", "1",
            "--log-level", "warning"]
    for name, path in (modules or {}).items():
        args += ["--module", f"{name}={path}"]
    return args


@pytest.fixture(scope="module")
def server_url(tiny_model_dir: Path, lora_dirs: dict[str, Path]) -> Iterator[str]:
    server = LocalServer(server_args(tiny_model_dir, lora_dirs), startup_timeout=120)
    anyio.run(server.start)
    try:
        yield server.url
    finally:
        anyio.run(server.stop)
