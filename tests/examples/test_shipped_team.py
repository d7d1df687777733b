"""The trained team that ships in examples/modules/: its base is a small patch of the default
model (the team's joint prefill) that rebuilds the family it records; each module joins that
base's family with its recorded layer split, fits in a few MB, and reproduces its recorded
accuracy on the check episodes through the engine (bf16, its base computing the shared context
first)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from server.kv.family import base_families, family_digest
from server.models.patch import read_patch
from server.modules.manifest import Manifest
from server.modules.registry import ModuleLoadError, identify

ROOT = Path(__file__).resolve().parents[2]
MODULES = ROOT / "examples" / "modules"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def team(default_model: Path):
    spec = importlib.util.spec_from_file_location("train_team", ROOT / "examples" / "train_team.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def family(team) -> str:
    return family_digest(team.team_base(), kv_dtype="bfloat16")


def test_the_team_base_is_a_small_patch_of_the_default_model(team) -> None:
    patch = read_patch(team.BASE_PATCH)
    assert patch["base"] == "default" and patch["rank"] == 16
    assert sum(p.stat().st_size for p in team.BASE_PATCH.iterdir()) < 12 << 20  # 9.4 MB, not the 540 MB base
    # built (or found) in the cache, it is the family the patch records (resolve_model_dir checks the build)
    assert family_digest(team.team_base(), kv_dtype="float32") == patch["family"]


@pytest.mark.parametrize("agent", ["retrieval", "planning", "coding"])
def test_a_shipped_module_holds_its_recorded_accuracy(team, family: str, agent: str) -> None:
    d = MODULES / agent
    record = json.loads((d / "heldout.json").read_text())
    manifest = Manifest.read(d)
    assert manifest is not None and manifest.recompute_layers == record["recompute_layers"] == team.TEAM[agent][1]
    found = identify(d, name=agent, family=family)
    assert found.shares_prefill and found.recompute_layers == record["recompute_layers"], found.reason
    assert (d / "adapter_model.safetensors").stat().st_size < 6 << 20  # a few MB, committed with the repo
    got = team.check(agent, d)  # on the threads it was recorded with
    want = record["check"]
    assert got["examples"] == want["examples"] == team.CHECK
    flips = sum(a != b for a, b in zip(got["correct"], want["correct"], strict=True))
    # bf16 on another CPU may break a near-tie differently: at most two of the episodes
    assert flips <= 2, (got["accuracy"], want["accuracy"])


def test_a_shipped_module_on_the_default_model_instead_of_its_base_is_refused(team, default_model: Path) -> None:
    """The default model has the team base's shapes but not its weights: the modules' updates
    would load and run there, on weights they were not trained for. Refused, naming the base."""
    ours = base_families(team.team_base())
    for agent in ("retrieval", "planning", "coding"):
        assert identify(MODULES / agent, name=agent, family=family_digest(team.team_base(), kv_dtype="float32"),
                        base_families=ours).reason.startswith("manifest names family")  # bf16 KV: served privately
        with pytest.raises(ModuleLoadError, match=f"module '{agent}': a LoRA adapter for another base model "
                                                  r"\(trained on .*patched-.*examples/modules/team-base"):
            identify(MODULES / agent, name=agent, family=family_digest(default_model, kv_dtype="bfloat16"),
                     base_families=base_families(default_model))
