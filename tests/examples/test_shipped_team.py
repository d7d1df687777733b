"""The trained team that ships in examples/modules/: each module joins the default model's family
with its recorded layer split, fits in a few MB, and reproduces its recorded accuracy on the
check episodes through the engine (bf16, its base computing the shared context first)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from server.kv.family import family_digest
from server.models.loader import default_model_dir
from server.modules.manifest import Manifest
from server.modules.registry import identify

ROOT = Path(__file__).resolve().parents[2]
MODULES = ROOT / "examples" / "modules"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def team():
    spec = importlib.util.spec_from_file_location("train_team", ROOT / "examples" / "train_team.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def family() -> str:
    return family_digest(default_model_dir(progress=False), kv_dtype="bfloat16")


@pytest.mark.parametrize("agent", ["retrieval", "planning", "coding"])
def test_a_shipped_module_holds_its_recorded_accuracy(team, family: str, agent: str) -> None:
    d = MODULES / agent
    record = json.loads((d / "heldout.json").read_text())
    manifest = Manifest.read(d)
    assert manifest is not None and manifest.recompute_layers == record["recompute_layers"] == team.TEAM[agent][1]
    found = identify(d, name=agent, family=family)
    assert found.shares_prefill and found.recompute_layers == record["recompute_layers"], found.reason
    assert (d / "adapter_model.safetensors").stat().st_size < 6 << 20  # a few MB, committed with the repo
    got = team.check(agent, d, threads=2)
    want = record["check"]
    assert got["examples"] == want["examples"] == team.CHECK
    flips = sum(a != b for a, b in zip(got["correct"], want["correct"], strict=True))
    # bf16 on another CPU may break a near-tie differently: at most two of the episodes
    assert flips <= 2, (got["accuracy"], want["accuracy"])
