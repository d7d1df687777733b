"""Every test's tier follows from its path and fixtures (conftest.py's ``tier_of``), never from a
hand-written marker: the rules on stand-in items, then on the real items of a few files, collected
as ``scripts/test`` collects them."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from conftest import BUDGETS, ROOT, TIERS, tier_of


class Item:
    """What tier_of reads of a pytest item: its path, its markers and its fixtures."""

    def __init__(self, path: str, fixtures: tuple[str, ...] = (), cuda: bool = False) -> None:
        self.path = ROOT / path
        self.fixturenames = fixtures
        self.cuda = cuda

    def get_closest_marker(self, name: str) -> Any:
        return object() if name == "cuda" and self.cuda else None


@pytest.mark.parametrize(("item", "tier"), [
    (Item("tests/server/kv/test_pool.py", ("tiny_model_dir",)), "default"),
    (Item("tests/sdk/test_demo.py", ("tmp_path", "default_model")), "model"),
    (Item("tests/benchmarks/test_layer_split.py", ("default_model",)), "bench"),
    (Item("tests/benchmarks/test_layer_split.py", ("tiny_model_dir",)), "default"),  # the twin
    (Item("tests/server/cluster/test_cluster.py", ("fault_cluster", "cluster", "tiny_model_dir")), "faults"),
    (Item("tests/vllm/test_vllm_engine.py", ("default_model",)), "vllm"),
    (Item("server/vllm/connector.py"), "vllm"),
    (Item("tests/cuda/test_device_engine.py", cuda=True), "cuda"),
    (Item("tests/cuda/test_device_engine.py"), "default"),  # its cpu parameter
])
def test_the_rules(item: Item, tier: str) -> None:
    assert tier_of(item) == tier  # type: ignore[arg-type]


def test_every_tier_has_a_budget() -> None:
    assert set(BUDGETS) == set(TIERS) and all(b > 0 for b in BUDGETS.values())


def test_the_real_items_of_a_few_files() -> None:
    files = ["tests/sdk/test_demo.py", "tests/benchmarks/test_headline_http.py",
             "tests/server/cluster/test_faults_sampling.py", "server/models/loader.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
                          "-p", "no:cacheprovider", "-m", "model or bench or faults", *files],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    got = {line.split("[")[0] for line in out.stdout.splitlines() if "::" in line}
    assert got == {
        "tests/sdk/test_demo.py::test_demo_on_the_default_model",
        "tests/benchmarks/test_headline_http.py::test_the_quick_headline_runs_every_arm_and_sharing_shows_in_the_cached_tokens",
        "tests/server/cluster/test_faults_sampling.py::test_router_health_is_degraded_while_an_agent_has_no_decode_worker_up",
        "server/models/loader.py::loader.default_model_dir",
    }, out.stdout + out.stderr
