"""A layer-split agent over HTTP: listed with its split, explained, counted, and served from a
pinned context."""

from __future__ import annotations

import httpx

from server.api.config import ServerConfig
from server.engine.build import load_engine
from server.engine.core import EngineConfig
from tests.server.api.test_sharing import MESSAGES, metric
from tests.server.helpers import running_server


def test_a_split_agent_is_listed_explained_counted_and_served(tiny_model_dir, make_lora) -> None:
    core = load_engine(tiny_model_dir, modules={"reader": make_lora("reader", seed=4, recompute_layers=1),
                                                "plain": make_lora("plain", seed=5)},
                       dtype="float32", config=EngineConfig(kv_cache_bytes=32 << 20))
    with running_server(core, ServerConfig(kv_cache_bytes=16 << 20, default_max_tokens=8)) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        agents = {a["name"]: a for a in c.get("/v1/agents").json()["data"]}
        assert agents["reader"]["recompute_layers"] == 1 and agents["plain"]["recompute_layers"] == 0
        assert "recomputes its top 1 layers" in agents["reader"]["reason"]

        ctx = c.post("/v1/contexts", json={"messages": MESSAGES}).json()
        ask = {"agent": "reader", "context_id": ctx["id"], "text": "Which columns?"}
        before = c.post("/v1/explain", json=ask).json()
        assert before["recompute_layers"] == 1 and before["cached_blocks"] == 0
        assert before["fill_blocks"] * 16 == ctx["pinned_tokens"]  # the pin's blocks: top layer only
        plain = c.post("/v1/explain", json={**ask, "agent": "plain"}).json()
        assert plain["fill_blocks"] == 0 and plain["cached_blocks"] * 16 == ctx["pinned_tokens"]

        r = c.post(f"/v1/contexts/{ctx['id']}/generate", json={"agent": "reader", "text": "Which columns?",
                                                             "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["cached_tokens"] == 0  # it computed its top layer over the prefix
        filled = metric(url, "agentshare_split_prefix_tokens_total")
        assert filled == ctx["pinned_tokens"]
        assert metric(url, "agentshare_split_saved_layer_rows_total") == 2 * filled  # 2 of 3 layers read

        after = c.post("/v1/explain", json=ask).json()
        assert after["cached_blocks"] * 16 == ctx["pinned_tokens"] and after["fill_blocks"] == 0
        again = c.post(f"/v1/contexts/{ctx['id']}/generate", json={"agent": "reader", "text": "Which columns?",
                                                                 "max_tokens": 4, "temperature": 0})
        assert again.json()["usage"]["cached_tokens"] >= ctx["pinned_tokens"]
        assert again.json()["text"] == r.json()["text"]
        assert metric(url, "agentshare_split_prefix_tokens_total") == filled  # read again, not recomputed


def test_what_sharing_costs_each_agent_is_listed_and_tabled(tiny_model_dir, make_lora, tmp_path) -> None:
    import dataclasses
    import shutil

    import anyio

    from agentshare import AsyncClient
    from server.modules.manifest import Manifest

    measured = tmp_path / "measured"
    shutil.copytree(make_lora("measured", seed=6, recompute_layers=1), measured)
    record = {"metric": "exact", "points": 1.0, "shared": 0.955, "own": 0.96, "gap_points": 0.5,
              "ci_points": [-1.0, 2.0], "recompute_layers": 1, "layers": 2, "probes": [{"k": 0, "score": 0.6}],
              "rows": {"train": 800, "held_out": 200}, "search_seconds": 12.0}
    dataclasses.replace(Manifest.read(measured), fidelity=record).write(measured)
    core = load_engine(tiny_model_dir, modules={"measured": measured, "plain": make_lora("plain", seed=5)},
                       dtype="float32", config=EngineConfig(kv_cache_bytes=32 << 20))
    with running_server(core, ServerConfig(kv_cache_bytes=16 << 20, default_max_tokens=8)) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        agents = {a["name"]: a for a in c.get("/v1/agents").json()["data"]}
        assert agents["measured"]["fidelity"]["gap_points"] == 0.5
        assert agents["measured"]["fidelity"]["rows"] == {"train": 800, "held_out": 200}
        assert agents["plain"]["fidelity"] is None and agents["base"]["fidelity"] is None
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert models["measured"]["fidelity"]["shared"] == 0.955 and models["plain"]["fidelity"] is None

        async def team():
            async with AsyncClient(url) as client:
                return await client.agents()

        listed = anyio.run(team)
    by_name = {a.name: a for a in listed}
    assert by_name["measured"].fidelity.recompute_layers == 1 and by_name["measured"].recompute_layers == 1
    table = listed.table()
    assert "95.5 % shared vs 96.0 % own prefill: -0.5 points [-2.0, +1.0], k = 1 of 2, 200 held-out rows" in table
    assert "not measured (train it with agentshare finetune --fidelity POINTS)" in table
    assert "<td>measured</td>" in listed._repr_html_()
