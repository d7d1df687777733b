"""How the vllm engine's instances are planned and started (no vLLM needed: the command lines)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.kv.family import family_digest
from server.vllm.launch import BASE, InstanceSpec, StoreConfig, command, plan_instances


def _kv_config(args: list[str]) -> dict:
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def test_a_node_plans_its_agents_without_a_base(tiny_model_dir: Path, coder_module_dir: Path) -> None:
    family = family_digest(tiny_model_dir, kv_dtype="float32")
    modules = {"coder": coder_module_dir}
    here = plan_instances(tiny_model_dir, modules, family=family, dtype="float32")
    node = plan_instances(tiny_model_dir, modules, family=family, dtype="float32", with_base=False)
    assert [s.name for s in here] == [BASE, "lora-0"]
    assert [s.name for s in node] == ["lora-0"] and node[0] == here[1]


def test_every_instance_loads_through_the_connector_and_fails_a_prefix_that_does_not_load(tmp_path: Path) -> None:
    spec = InstanceSpec("lora-0", tmp_path, "base", loras={"coder": tmp_path / "coder"}, max_lora_rank=12,
                        modules={"base": "f", "coder": "f"}, compile=False)
    args = command(spec, port=8123, dtype="float32", store=StoreConfig(tmp_path / "kv", 1 << 20, "f"),
                   max_model_len=2048, kv_cache_bytes=1 << 29)
    kv = _kv_config(args)
    assert kv["kv_connector_module_path"] == "server.vllm.connector"
    assert kv["kv_load_failure_policy"] == "fail"  # never recomputed: the frontend prefills privately
    assert kv["kv_connector_extra_config"]["modules"] == {"base": "f", "coder": "f"}
    assert args[args.index("--host") + 1] == "127.0.0.1"  # instances are never reachable from the network
    assert args[args.index("--max-lora-rank") + 1] == "16"  # vLLM's next rank bucket
    assert "--enforce-eager" in args and f"coder={tmp_path / 'coder'}" in args


def test_a_layer_split_module_is_refused_before_any_instance_starts(tiny_model_dir: Path, make_lora) -> None:
    from server.vllm.launch import agent_card

    family = family_digest(tiny_model_dir, kv_dtype="float32")
    split = make_lora("split", recompute_layers=1)
    for call in (lambda: plan_instances(tiny_model_dir, {"split": split}, family=family, dtype="float32"),
                 lambda: agent_card(split, name="split", family=family)):
        with pytest.raises(ValueError, match="the vllm engine cannot serve the layer split"):
            call()
