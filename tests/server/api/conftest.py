"""Fixtures of the API tests: the real server (uvicorn on loopback, in a thread) over the tiny
model with two LoRA agents of its family, one server per test module."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from server.api.config import ServerConfig
from server.engine.build import load_engine
from server.engine.core import EngineConfig, EngineCore
from server.kv.family import family_digest
from server.modules.manifest import LoraSpec, Manifest, ModuleKind
from tests.server.helpers import running_server

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
AGENTS = ("coder", "planner")


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("AGENTSHARE_CACHE_DIR", str(tmp_path_factory.mktemp("agentshare-cache")))
    yield
    mp.undo()


def make_lora_module(base_dir: Path, out: Path, name: str, family: str, seed: int) -> Path:
    """A random (non-zero) peft LoRA adapter with a manifest joining ``family``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS),
                                                init_lora_weights=False))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.05)
    model.save_pretrained(out)
    Manifest(name=name, kind=ModuleKind.LORA, family=family, lora=LoraSpec(4, 8.0, LORA_TARGETS)).write(out)
    return out


@pytest.fixture(scope="session")
def agent_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    family = family_digest(tiny_model_dir, kv_dtype="float32")
    return {name: make_lora_module(tiny_model_dir, tmp_path_factory.mktemp(f"lora-{name}"), name, family, seed=i + 1)
            for i, name in enumerate(AGENTS)}


@pytest.fixture(scope="session")
def tiny_core(tiny_model_dir: Path, agent_dirs: dict[str, Path]) -> EngineCore:
    """The tiny base with two LoRA agents, fp32 (cores for servers are made with with_config)."""
    return load_engine(tiny_model_dir, modules=agent_dirs, dtype="float32",
                       config=EngineConfig(kv_cache_bytes=32 << 20))


@pytest.fixture(scope="module")
def start_server(tiny_core: EngineCore) -> Iterator[Callable[..., str]]:
    """``start_server(**ServerConfig fields) -> base URL``; every server stops with the module."""
    with contextlib.ExitStack() as stack:
        def start(**fields: object) -> str:
            fields.setdefault("kv_cache_bytes", 16 << 20)
            fields.setdefault("default_max_tokens", 16)
            return stack.enter_context(running_server(tiny_core, ServerConfig(**fields)))  # type: ignore[arg-type]

        yield start


@pytest.fixture(scope="module")
def server_url(start_server: Callable[..., str]) -> str:
    """One default server per test module (no auth)."""
    return start_server()
