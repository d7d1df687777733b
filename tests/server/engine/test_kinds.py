"""Decode-module kinds are a registry: a new kind is one class and one ``register`` call, and
the engine serves it without any other change."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from server.engine import kinds
from server.engine.build import load_engine
from server.engine.core import EngineConfig
from server.engine.modules import DecodeModule
from server.engine.sampling import SamplingParams
from server.prompt import Placement, chat_prompt


class Mirror:
    """A toy kind: its rows run in a forward of their own, over a copy of the base's weights."""

    name = "mirror"
    own_forward = True

    def __init__(self) -> None:
        self.attached: list[str] = []

    def load(self, path: Path, **_: object) -> None:
        return None

    def attach(self, runner, module: DecodeModule) -> None:
        self.attached.append(module.name)
        runner.add_forward(module.name, runner.forward.weights)


@pytest.fixture
def mirror():
    kind = kinds.register(Mirror())
    yield kind
    kinds.KINDS.unregister(kind.name)


def test_the_built_in_kinds_are_registered_and_unknown_ones_named():
    assert {"base", "lora", "full"} <= set(kinds.KINDS)
    assert kinds.kind_of("full").own_forward and not kinds.kind_of("lora").own_forward
    with pytest.raises(ValueError, match=r"unknown decode-module kind 'nope'; registered decode-module kinds: base, lora, full \(add one"):
        kinds.kind_of("nope")
    with pytest.raises(ValueError, match="already registered"):
        kinds.register(kinds.kind_of("lora"))


def test_a_registered_kind_is_served_and_computes_exactly_what_its_weights_say(
    tiny_model_dir, tiny_family, smollm2_tokenizer, mirror
):
    core = load_engine(tiny_model_dir, dtype="float32").with_config(EngineConfig(kv_cache_bytes=32 << 20))
    modules = {**core.modules, "twin": DecodeModule("twin", "mirror", "t" * 64, True, Placement.TURN)}
    core = type(core)(core.forward, core.tokenizer, family=core.family, modules=modules,
                      config=EngineConfig(kv_cache_bytes=32 << 20))
    assert mirror.attached == ["twin"]
    context = [{"role": "user", "content": "Shared notes: " + " ".join(f"item {i}." for i in range(30))}]
    prompt = chat_prompt(smollm2_tokenizer, context, [{"role": "user", "content": "Which item?"}])
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    core.add_request("base", "base", prompt, greedy)
    core.add_request("twin", "twin", prompt, greedy)
    out: dict[str, list[int]] = defaultdict(list)
    while core.has_work:
        for e in core.step():
            if e.token_id is not None:
                out[e.request_id].append(e.token_id)
    assert len(out["twin"]) == 6 and out["twin"] == out["base"]  # the same weights give the same tokens
    assert core.stats.cached_prompt_tokens > 0  # the twin read the base's shared prefix
    assert core.stats.module_rows > 0  # its own rows went through its own forward
