"""Fixtures of the whole repository: the tiny models, and the examples that run.

The tiny models serve ``tests/`` and the doctests of ``agentshare/`` and ``server/`` alike: a
tiny random Llama-family model with the real SmolLM2 tokenizer and chat template, so template and
invocation-point logic are tested for real. Weights are scaled up (``initializer_range=0.1``) so
attention is peaked rather than uniform: masking or position bugs then change logits visibly.

Doctests and the Python blocks of ``README.md`` and ``docs/`` run as notebook cells
(:mod:`tests.notebook`: top-level ``await``). Besides its module's globals, a doctest finds the
names of :data:`DOCTEST_NAMES` (each built only for a docstring that reads it), and runs in a
fresh temporary directory.

Every test gets its tier here, from where it lives and the fixtures it uses, never by hand
(:func:`tier_of`; the budgets are in ``tests/tiers.toml``)::

    vllm     tests/vllm/, server/vllm/connector.py   real vLLM instances (.venv-vllm)
    cuda     a ``cuda`` device parameter             needs a CUDA device (scripts/device-check)
    faults   the ``fault_cluster`` fixture            kills and restarts workers in real time
    bench    tests/benchmarks/ + ``default_model``    a benchmark script at full size
    model    the ``default_model`` fixture            loads the default model (also README.md's
                                                      blocks and ``# doctest: +MODEL`` examples)
    default  everything else                          unit and tiny-model tests

``pytest`` alone runs the default tier (``addopts``); ``scripts/test`` runs default, model,
faults and vllm (what CI runs), ``scripts/test --fast`` the default tier (on two xdist workers:
:class:`ScopeScheduling`), ``--all`` every tier. A benchmark run at full size (bench) keeps a
tiny-model twin of the same script in the default tier, in the same file.
"""

from __future__ import annotations

import asyncio
import doctest
import os
import tomllib
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _pytest.doctest import DoctestItem
from sybil import Sybil
from sybil.integration.pytest import SybilItem
from sybil.parsers.markdown import CodeBlockParser, SkipParser
from xdist.scheduler import LoadScopeScheduling

from tests import smollm2
from tests.notebook import LOOP, CellEvaluator, doctest_names, top_level_await

# Serving processes the suite starts would each start a background build of the fused
# elementwise kernels for the model shape they serve (server/engine/elementwise.py); the tests
# of that module build them where they are the subject.
os.environ.setdefault("AGENTSHARE_FUSED", "off")

TINY_LLAMA: dict[str, Any] = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    initializer_range=0.1,
)


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The real SmolLM2-135M-Instruct tokenizer (with chat template), read from its GGUF."""
    return smollm2.tokenizer()


@pytest.fixture(scope="session")
def make_tiny_model(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any
) -> Callable[..., Path]:
    """Factory: ``make_tiny_model(name, **config_overrides) -> model dir`` (fp32, seeded, cached).

    The directory holds config, safetensors weights and the real SmolLM2 tokenizer + template;
    the vocabulary is the tokenizer's. Overrides may change ``model_type`` (llama, qwen2,
    qwen3, mistral) and any config field.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    made: dict[str, tuple[dict[str, Any], Path]] = {}

    def make(name: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        params = {**TINY_LLAMA, **overrides, "seed": seed}
        if name in made:
            assert made[name][0] == params, f"tiny model {name!r} requested with other settings"
            return made[name][1]
        made_params = dict(params)
        params.pop("seed")
        model_type = params.pop("model_type")
        config = AutoConfig.for_model(model_type, vocab_size=len(smollm2_tokenizer), **params)
        with torch.random.fork_rng():  # seeded weights without touching the tests' global RNG
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        model.save_pretrained(path)
        smollm2_tokenizer.save_pretrained(path)
        made[name] = (made_params, path)
        return path

    return make


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default model's directory (SmolLM2-135M-Instruct, converted from its GGUF on first use).
    A test that uses it is in the ``model`` tier (``bench`` under tests/benchmarks/), including a
    test that only starts a process on it (the demo, a benchmark script, the shipped team's base)."""
    from server.models.loader import default_model_dir

    return default_model_dir(progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model: Callable[..., Path]) -> Path:
    """A tiny random Llama (3 layers, hidden 256, 4 q / 2 kv heads of 64, tied embeddings)."""
    return make_tiny_model("llama")


# ---- doctests -------------------------------------------------------------------------------

MODEL = doctest.register_optionflag("MODEL")  # `# doctest: +MODEL`: the docstring loads the default model (tier model)

try:  # the vllm engine (its connector subclasses vLLM's, tests/vllm start vLLM): only where vLLM is installed
    import vllm  # noqa: F401
except ImportError:
    collect_ignore = ["server/vllm/connector.py", "tests/vllm"]

DOCTEST_NAMES = {  # a name a doctest may read -> the fixture that gives it
    "model_dir": "tiny_model_dir",  # a model directory (the tiny model)
    "coder_dir": "coder_module_dir",  # a decode module (LoRA) of its fp32 family
    "url": "tiny_server_url",  # a server of both (agents base and coder)
    "client": "doctest_client",  # an AsyncClient connected to it
}


@pytest.fixture(scope="session")
def coder_module_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LoRA decode module named ``coder``, with a manifest joining the tiny model's fp32 family."""
    from server.kv.family import family_digest
    from tests.server.api.conftest import make_lora_module

    family = family_digest(tiny_model_dir, kv_dtype="float32")
    return make_lora_module(tiny_model_dir, tmp_path_factory.mktemp("coder"), "coder", family, seed=1)


@pytest.fixture(scope="session")
def tiny_server_url(tiny_model_dir: Path, coder_module_dir: Path) -> Iterator[str]:
    """A server (uvicorn in a thread, fp32) of the tiny model with agents ``base`` and ``coder``."""
    from server.api.config import ServerConfig
    from server.engine.build import load_engine
    from server.engine.core import EngineConfig
    from tests.server.helpers import running_server

    core = load_engine(tiny_model_dir, modules={"coder": coder_module_dir}, dtype="float32",
                       config=EngineConfig(kv_cache_bytes=16 << 20))
    with running_server(core, ServerConfig(kv_cache_bytes=16 << 20, default_max_tokens=16)) as url:
        yield url


@pytest.fixture
def doctest_loop() -> Iterator[asyncio.Runner]:
    """The event loop of one docstring (its cells share it, as a notebook's do)."""
    with asyncio.Runner() as loop:
        yield loop


@pytest.fixture
def doctest_client(doctest_loop: asyncio.Runner, tiny_server_url: str) -> Iterator[Any]:
    from agentshare import AsyncClient

    client = AsyncClient(tiny_server_url)
    yield client
    doctest_loop.run(client.aclose())


@pytest.fixture(autouse=True)
def _doctest_namespace(request: pytest.FixtureRequest) -> Iterator[None]:
    """For a doctest: the names it reads from :data:`DOCTEST_NAMES`, top-level await, a temp cwd."""
    if not isinstance(request.node, DoctestItem):
        yield
        return
    namespace: dict[str, Any] = request.getfixturevalue("doctest_namespace")
    loop: asyncio.Runner = request.getfixturevalue("doctest_loop")
    request.getfixturevalue("monkeypatch").chdir(request.getfixturevalue("tmp_path"))
    wanted = doctest_names(request.node.dtest) & DOCTEST_NAMES.keys()
    namespace.update({name: request.getfixturevalue(DOCTEST_NAMES[name]) for name in wanted})
    try:
        with top_level_await(loop):
            yield
    finally:
        for name in wanted:
            del namespace[name]


# ---- tiers ----------------------------------------------------------------------------------

TIERS = ("default", "model", "bench", "faults", "vllm", "cuda")
ROOT = Path(__file__).resolve().parent
BUDGETS: dict[str, float] = {t: float(v["budget_s"]) for t, v in tomllib.loads((ROOT / "tests" / "tiers.toml").read_text()).items()}


def tier_of(item: pytest.Item) -> str:
    """The item's tier, from its path and its fixtures (the table in this module's docstring)."""
    path = Path(str(item.path)).resolve().relative_to(ROOT).as_posix()
    if path.startswith("tests/vllm/") or path == "server/vllm/connector.py":
        return "vllm"
    if item.get_closest_marker("cuda") is not None:  # a `cuda` device parameter (tests/cuda)
        return "cuda"
    fixtures = set(getattr(item, "fixturenames", ()))
    if "fault_cluster" in fixtures:
        return "faults"
    model = ("default_model" in fixtures
             or (isinstance(item, DoctestItem) and any(e.options.get(MODEL) for e in item.dtest.examples))
             or (isinstance(item, SybilItem) and "sybil:default-model" in item.name))
    if model:
        return "bench" if path.startswith("tests/benchmarks/") else "model"
    return "default"


def xdist_scope(nodeid: str) -> str:
    """Which tests one pytest-xdist worker runs together, in collection order (scripts/test runs
    ``--dist loadgroup``, scheduled by :class:`ScopeScheduling`): a document's blocks (they run in
    order in one namespace, as a notebook's cells), and every cluster test (they share one cluster
    of processes, the session's costliest fixture); any other test on its own, dealt to whichever
    worker is free (measured on the default tier, 2 cores: 345 s against 417 s with a file to a
    worker; the module fixtures some files then start on both workers cost less than the wait).
    From the node id alone, as xdist's controller sees a test."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/server/cluster/"):
        return "tests/server/cluster"
    return path if path.endswith(".md") else nodeid


class ScopeScheduling(LoadScopeScheduling):
    """xdist's scope scheduling (whole scopes to a worker, a scope's tests in collection order, the
    largest scopes first) on :func:`xdist_scope`. Not xdist's own loadgroup: it groups by the
    ``xdist_group`` mark, which it writes into ``item._nodeid``; pytest 9.2 (installed here) no
    longer reads that (a node id is ``Node._id``), so every test was a scope of its own and a
    document's blocks went to both workers (NameError in docs/sdk.md and docs/walkthrough.md:
    their first blocks had run on the other worker)."""

    def _split_scope(self, nodeid: str) -> str:
        return xdist_scope(nodeid)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> ScopeScheduling | None:
    return ScopeScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    for item in items:  # marked before -m deselects
        tier = tier_of(item)
        item.user_properties.append(("tier", tier))
        if tier != "default":
            item.add_marker(getattr(pytest.mark, tier))
    yield
    # A document's blocks run together and in order, as a notebook's cells, even in a shuffled run
    # (pytest-randomly shuffles them with the doctests, as items of no module): put them back so,
    # where the first of them stands.
    first = next((i for i, item in enumerate(items) if isinstance(item, SybilItem)), None)
    if first is None:
        return
    documents: dict[Path, list[SybilItem]] = {}
    for item in items:
        if isinstance(item, SybilItem):
            documents.setdefault(item.path, []).append(item)
    others = [item for item in items if not isinstance(item, SybilItem)]
    blocks = [b for document in documents.values() for b in sorted(document, key=lambda b: b.example.line)]
    items[:] = [*others[:first], *blocks, *others[first:]]


class TierClock:
    """Adds up each tier's test time (setup, call and teardown) and prints it against its budget
    in tests/tiers.toml at the end of a run (said, not enforced: hosts differ by 2x; CI's own limit
    is the whole run's)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.tests: dict[str, set[str]] = defaultdict(set)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        tier = dict(report.user_properties).get("tier")
        if isinstance(tier, str):
            self.spent[tier] += report.duration
            self.tests[tier].add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.spent:
            return
        terminalreporter.section("tiers (test time, setup to teardown, against tests/tiers.toml)")
        for tier in TIERS:
            if tier in self.spent:
                budget = BUDGETS[tier]
                over = "  OVER BUDGET" if self.spent[tier] > budget else ""
                terminalreporter.write_line(f"{tier:8} {len(self.tests[tier]):5} tests  {self.spent[tier]:8.1f} s"
                                            f" of {budget:6.0f} s{over}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(TierClock(), "agentshare-tier-clock")


# ---- README.md and docs/ --------------------------------------------------------------------
# Each document runs in order in one namespace, as a notebook (sybil). Its blocks find the tiny
# model, a module and a server under their fixture names (used by invisible setup blocks), and
# `AsyncClient()` launches the tiny model (AGENTSHARE_MODEL). README.md runs as written: on the
# default model, so in the model tier (it converts the model on first use, then runs three agents).


@pytest.fixture(scope="module")
def docs_environment(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[None]:
    """For one document: run from the repository root; a launched server loads the tiny model."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(request.config.rootpath)
        mp.setenv("AGENTSHARE_MODEL", str(tiny_model_dir))
        yield


@pytest.fixture(scope="module")
def readme_environment(request: pytest.FixtureRequest) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(request.config.rootpath)
        mp.delenv("AGENTSHARE_MODEL", raising=False)
        yield


def _open_document(namespace: dict[str, Any]) -> None:
    namespace[LOOP] = asyncio.Runner()


def _close_document(namespace: dict[str, Any]) -> None:
    namespace.pop(LOOP).close()


_PARSERS = [CodeBlockParser("python", CellEvaluator()), SkipParser()]
pytest_collect_file = (
    Sybil(parsers=_PARSERS, patterns=["docs/*.md"], setup=_open_document, teardown=_close_document,
          fixtures=["docs_environment", "tiny_model_dir", "coder_module_dir", "tiny_server_url"], name="docs")
    + Sybil(parsers=_PARSERS, patterns=["README.md"], setup=_open_document, teardown=_close_document,
            fixtures=["readme_environment"], name="default-model")
).pytest()
