"""A layer-split agent in a disaggregated cluster (real worker and router processes): the
launcher has the prefill worker keep the input of the agent's split layer, the router moves the
prefix with it, and the decode worker recomputes only the agent's top layers over the moved
blocks, with the output of one colocated engine."""

from __future__ import annotations

from pathlib import Path

import httpx

from server.cluster.launch import plan_workers, split_depths
from server.engine.build import load_engine
from server.engine.core import EngineConfig
from tests.server.cluster.conftest import API_KEYS, bearer, fresh, start_cluster
from tests.server.helpers import running_server

DOC = "Shared notes: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))


def ask(url: str, doc: str) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", headers=bearer(API_KEYS[0]), timeout=120, json={
        "model": "splitter", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": doc}, {"role": "user", "content": "Which item is 5?"}]})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_split_agent_fills_from_blocks_a_prefill_worker_sent_with_their_hidden_state(
    tiny_model_dir: Path, make_lora, worker_config, tmp_path: Path
):
    modules = {"splitter": make_lora("splitter-cluster", seed=11, recompute_layers=1)}
    assert split_depths(modules, tiny_model_dir) == (2,)  # 3 layers, the top one recomputed
    doc = fresh(DOC)
    core = load_engine(tiny_model_dir, modules=modules, dtype="float32", config=EngineConfig(kv_cache_bytes=16 << 20))
    with running_server(core, worker_config) as colocated:
        want = ask(colocated, doc)
    specs = plan_workers(1, 1, modules, threads=1, keep_hidden=split_depths(modules, tiny_model_dir))
    assert specs[0].keep_hidden == (2,) and specs[1].keep_hidden == ()
    with start_cluster(specs, worker_config, tmp_path, router_args=(
            "--offload-threshold", "64", "--transfer-codec", "fp32", "--no-bandwidth-aware")) as running:
        info = [httpx.get(f"{u}/internal/info", headers=running.internal, timeout=10).json()
                for u in running.workers.urls]
        assert [i["hidden_depths"] for i in info] == [[2], [2]]
        got = ask(running.url, doc)
        prefill, decode = running.stats()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert decode["imported_blocks"] > 0 and prefill["exported_blocks"] == decode["imported_blocks"]
    moved = decode["imported_blocks"] * 16
    assert decode["recomputed_prefix_tokens"] == moved  # its top layer only, over every moved block
    assert decode["split_saved_layer_rows"] == moved * 2
