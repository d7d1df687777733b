"""Every test's tier follows from its path and fixtures (conftest.py's ``tier_of``), never from a
hand-written marker: the rules on stand-in items, then on the real items of a few files, collected
as ``scripts/test`` collects them. And which tests one xdist worker runs together (``xdist_scope``):
the rule, then xdist's scheduler on it."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import (
    BUDGETS,
    ROOT,
    TIERS,
    ScopeScheduling,
    pytest_xdist_make_scheduler,
    tier_of,
    xdist_scope,
)


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


@pytest.mark.parametrize(("nodeid", "scope"), [
    ("docs/sdk.md::sybil:docs,line:14,column:1", "docs/sdk.md"),  # a document's blocks: one scope
    ("docs/sdk.md::sybil:docs,line:18,column:1", "docs/sdk.md"),
    ("docs/sdk.md::sybil:docs,line:18,column:1@docs/sdk.md", "docs/sdk.md"),  # xdist's group suffix
    ("tests/server/cluster/test_cluster.py::test_x[a::b]", "tests/server/cluster"),  # every cluster test
    ("tests/server/cluster/test_tracing.py::test_y", "tests/server/cluster"),
    ("tests/test_tiers.py::test_the_rules[item0-default]", "tests/test_tiers.py::test_the_rules[item0-default]"),
    ("server/api/serve.py::server.api.serve", "server/api/serve.py::server.api.serve"),  # a doctest
])
def test_the_xdist_scopes(nodeid: str, scope: str) -> None:
    assert xdist_scope(nodeid) == scope


class Worker:
    """What xdist's scheduler reads and calls of a worker: it records the tests sent to it."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def test_on_two_workers_a_documents_blocks_run_on_one_in_order() -> None:
    """xdist's own loadgroup dealt a document's blocks to both workers under this pytest (NameError
    in docs/sdk.md: its first block had run on the other worker); scripts/test's ``--dist loadgroup``
    gets conftest.py's scheduler, which keeps a document's blocks and the cluster tests together."""
    options = {"dist": "loadgroup", "tx": ["popen", "popen"]}
    config = SimpleNamespace(getvalue=options.get, option=SimpleNamespace(loadscopereorder=True))
    scheduler = pytest_xdist_make_scheduler(config, None)  # type: ignore[arg-type]
    assert isinstance(scheduler, ScopeScheduling)
    blocks = [f"docs/sdk.md::sybil:docs,line:{line},column:1" for line in (14, 18, 65, 117)]
    cluster = ["tests/server/cluster/test_cluster.py::test_a", "tests/server/cluster/test_tracing.py::test_b"]
    collection = [*(f"tests/test_a.py::test_{i}" for i in range(6)), *cluster, *blocks, "tests/test_b.py::test_0"]
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)  # type: ignore[arg-type]
        scheduler.add_node_collection(worker, collection)  # type: ignore[arg-type]
    scheduler.schedule()
    done = dict.fromkeys(workers, 0)
    while any(done[w] < len(w.sent) for w in workers):  # each worker runs what it was sent, in turn
        for worker in workers:
            if done[worker] < len(worker.sent):
                scheduler.mark_test_complete(worker, worker.sent[done[worker]])  # type: ignore[arg-type]
                done[worker] += 1
    ran = {worker.gateway.id: [collection[i] for i in worker.sent] for worker in workers}
    assert sorted(t for tests in ran.values() for t in tests) == sorted(collection)
    assert all(len(tests) > 1 for tests in ran.values())  # both workers got tests
    for tests in ran.values():
        assert [t for t in tests if t in blocks] in ([], blocks)
        assert [t for t in tests if t in cluster] in ([], cluster)
