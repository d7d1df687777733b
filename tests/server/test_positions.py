"""The one rule of who computes each position (server/positions.py), and that the engine, the
router's agent cards and the simulator all read it."""

from __future__ import annotations

import pytest

from server import positions
from server.backend import AgentCard
from server.engine.modules import DecodeModule, base_module
from server.kv.keys import NamespaceKind
from server.prompt import Placement, Prompt

FAMILY = "f" * 64
PROMPT = Prompt(tuple(range(50)), context_len=33, turn_start=35, header_start=45)


def lora(shares: bool, placement: Placement = Placement.TURN) -> DecodeModule:
    return DecodeModule("coder", "lora", "c" * 64, shares, placement)


@pytest.mark.parametrize(("module", "ip"), [
    (base_module(FAMILY), 50),
    (lora(True, Placement.TURN), 35),
    (lora(True, Placement.HEADER), 45),
    (lora(False, Placement.HEADER), 0),
])
def test_the_invocation_point_of_each_kind_of_module(module, ip):
    assert positions.invocation_point(PROMPT, module) == ip
    card = AgentCard(module.name, module.kind, None, module.shares_prefill, str(module.placement))
    assert positions.invocation_point(PROMPT, card) == ip  # the router's view agrees


def test_the_ip_never_passes_the_last_prompt_token_and_the_shared_prefix_is_whole_blocks():
    short = Prompt(tuple(range(20)), 20, 20, 20)  # a context with no turn of its own
    assert positions.invocation_point(short, lora(True)) == 19
    assert positions.shared_prefix_len(PROMPT, lora(True), block_size=16) == 32
    assert positions.shared_prefix_len(PROMPT, base_module(FAMILY), block_size=16) == 48
    assert positions.shared_prefix_len(PROMPT, lora(False), block_size=16) == 0
    assert positions.shared_prefix_len(PROMPT, lora(True, Placement.HEADER), block_size=16) == 32


def test_layouts_key_blocks_by_who_computed_them():
    base = positions.layout(base_module(FAMILY), 50, family=FAMILY, salt="t")
    assert base.module is None and base.family.owner == FAMILY and base.family.salt == "t"
    mod = positions.layout(lora(True), 35, family=FAMILY, salt="t")
    assert mod.family == base.family  # the shared part: the same namespace as the base's
    assert mod.module is not None and mod.module.kind is NamespaceKind.MODULE
    assert (mod.module.owner, mod.module.invocation_point, mod.module.salt) == ("c" * 64, 35, "t")
    kinds = [mod.namespace_of(i, block_size=16).kind for i in range(4)]
    assert kinds == [NamespaceKind.FAMILY, NamespaceKind.FAMILY, NamespaceKind.MODULE, NamespaceKind.MODULE]


def test_sharing_off_keys_each_module_apart_and_a_lossy_prefix_apart_from_exact_ones():
    on = positions.layout(lora(True), 35, family=FAMILY)
    off = positions.layout(lora(True), 35, family=FAMILY, share_prefill=False)
    base_off = positions.layout(base_module(FAMILY), 50, family=FAMILY, share_prefill=False)
    assert len({on.family.digest, off.family.digest, base_off.family.digest}) == 3
    lossy = positions.layout(lora(True), 35, family=FAMILY, prefix_codec="int8")
    assert lossy.family.codec == "int8" and not lossy.family.is_exact and lossy.module == on.module
    private = positions.layout(lora(False), 0, family=FAMILY, prefix_codec="int8")
    assert private.family.is_exact  # nothing before IP 0 crossed a codec


def test_the_engine_serves_by_the_rule(tiny_model_dir):
    from server.engine.build import load_engine

    core = load_engine(tiny_model_dir, dtype="float32")
    ip, lay = core._layout(core.modules["base"], PROMPT, "t", None)
    assert (ip, lay) == (50, positions.layout(core.modules["base"], 50, family=core.family, salt="t"))


def test_the_default_tenant_and_a_one_token_shared_prefix():
    assert positions.layout(lora(True), 35, family=FAMILY).family.salt == ""  # the single default tenant
    one = positions.layout(lora(True), 1, family=FAMILY, prefix_codec="int8")
    assert one.family.codec == "int8"  # position 0 was the base's, and it crossed the codec


def split(shares: bool, k: int) -> DecodeModule:
    return DecodeModule("reader", "lora", "r" * 64, shares, Placement.TURN, recompute_layers=k)


def test_the_split_layer_of_each_kind_of_module():
    assert positions.split_layer(split(True, 8), 30) == 22
    assert positions.split_layer(split(True, 30), 30) == 0  # every layer: a private prefill's work
    assert positions.split_layer(split(False, 8), 30) == 30  # a private prefill: nothing is the base's
    assert positions.split_layer(base_module(FAMILY), 30) == 30
    assert positions.split_layer(lora(True), 30) == 30
    with pytest.raises(ValueError, match=r"recompute_layers 31 is outside 0\.\.30"):
        positions.split_layer(split(True, 31), 30)


def test_a_split_modules_prefix_blocks_live_in_its_split_namespace():
    from server.kv.keys import Namespace

    lay = positions.layout(split(True, 8), 35, family=FAMILY, salt="t")
    assert lay.prefix == Namespace.split("r" * 64, recompute_layers=8, salt="t")
    assert [lay.namespace_of(i, block_size=16).kind for i in range(3)] == [
        NamespaceKind.SPLIT, NamespaceKind.SPLIT, NamespaceKind.MODULE]
    lossy = positions.layout(split(True, 8), 35, family=FAMILY, salt="t", prefix_codec="int8")
    assert lossy.prefix == Namespace.split("r" * 64, recompute_layers=8, salt="t").lossy("int8")
    assert positions.layout(lora(True), 35, family=FAMILY).prefix is None
    assert positions.layout(split(False, 8), 0, family=FAMILY).prefix is None  # private: no split
