"""The vllm engine across hosts: a frontend (``serve --engine vllm --node URL``: the base and the
coder) and an ``agentshare vllm-node`` serving the coder and the planner from a store of its own. The prefix crosses
between the two stores over the cluster's TCP transport, as it would between two machines."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.cluster.auth import HEADER, ClusterSecret
from server.process import free_port, wait_ready
from tests.vllm.conftest import KEYS, VllmServer, chat, launch, messages_for, serve_vllm, stop

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "cluster.secret"
    ClusterSecret.generate().write(path)
    return path


@pytest.fixture(scope="module")
def node(base_dir: Path, modules: dict[str, Path], secret_file: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm-node") / "node.log"
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(log.parent / "vllm-cache")}
    proc = launch(["vllm-node", "--enforce-eager", "--dtype", "float32", "--model", str(base_dir), "--port", str(port),
                   "--kv-cache", "512MiB", "--kv-store", "1GiB", "--cluster-secret-file", str(secret_file),
                   "--module", f"coder={modules['coder']}", "--module", f"planner={modules['planner']}"], log, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url + "/health", deadline=time.monotonic() + 480, what="agentshare vllm-node",
                   hint=f"; see {log}", poll=1.0)
        yield VllmServer(url, proc, log)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def frontend(base_dir: Path, modules: dict[str, Path], node: VllmServer, secret_file: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm-front") / "serve.log"
    # the coder here too: an agent with two places
    yield from serve_vllm(["--model", str(base_dir), "--module", f"coder={modules['coder']}", "--node", node.url,
                           "--cluster-secret-file", str(secret_file)], log, what="agentshare serve --engine vllm --node")


def _node_stats(node: VllmServer, secret_file: Path) -> dict:
    r = httpx.get(node.url + "/internal/vllm/stats", headers=ClusterSecret.from_file(secret_file).headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_agents_on_another_host_decode_from_the_frontends_base_prefill(
        frontend: VllmServer, node: VllmServer, secret_file: Path, oracle) -> None:
    """The planner (served by the node only), twice on one context: the prefix crosses once."""
    m = [messages_for("node", "Write a function that uses os.path."),
         messages_for("node", "Plan a refactor of this module in three steps.")]
    before = _node_stats(node, secret_file)
    saved = frontend.store_counter("saved_blocks")
    first = chat(frontend, "planner", m[0])
    after_first = _node_stats(node, secret_file)
    second = chat(frontend, "planner", m[1])
    after = _node_stats(node, secret_file)
    for messages, body in zip(m, (first, second), strict=True):
        want, ip = oracle("planner", messages)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == ip, body["usage"]
        assert body["choices"][0]["message"]["content"] == want
    blocks = -(-ip // 128)
    # the base prefilled once, on the frontend's host; its blocks crossed to the node once
    assert frontend.store_counter("saved_blocks") - saved == blocks
    assert after_first["received_blocks"] - before["received_blocks"] == blocks
    assert after["received_blocks"] == after_first["received_blocks"]  # the second request found them there
    assert after_first["store"]["loaded_blocks"] - before["store"]["loaded_blocks"] == blocks
    # the second: vLLM's own prefix cache holds the planner's full blocks of the first; the rest from the store
    assert after["store"]["loaded_blocks"] - after_first["store"]["loaded_blocks"] >= 1
    assert after["pins"] == 0  # each request's pin on the node ended with it
    assert frontend.metric("agentshare_vllm_node_push", 'counter="blocks"') == after["received_blocks"]
    assert frontend.metric("vllm:external_prefix_cache_hits_total", 'instance="node-0/lora-0"') >= ip


def test_requests_that_meet_on_their_way_to_a_node_send_the_prefix_once(
        frontend: VllmServer, node: VllmServer, secret_file: Path, oracle) -> None:
    m = [messages_for("together", "Write a function that uses os.path."),
         messages_for("together", "Plan a refactor of this module in three steps.")]
    before = _node_stats(node, secret_file)

    async def both() -> list[dict]:
        return await asyncio.gather(*(asyncio.to_thread(chat, frontend, "planner", x) for x in m))

    bodies = asyncio.run(both())
    after = _node_stats(node, secret_file)
    for messages, body in zip(m, bodies, strict=True):
        want, ip = oracle("planner", messages)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == ip, body["usage"]
        assert body["choices"][0]["message"]["content"] == want
    assert after["received_blocks"] - before["received_blocks"] == -(-ip // 128)
    assert after["pins"] == 0


def test_an_agent_served_here_and_on_a_node_goes_where_its_prefix_is(frontend: VllmServer, oracle) -> None:
    """The coder runs on both hosts. On a pinned context (prefilled by the base, so in this
    host's store and not the node's) the placement policy keeps it here; the planner, on the
    node only, gets the context's blocks moved there, as its timeline says."""
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    m = messages_for("placement", "Write a function that uses os.path.")
    r = httpx.post(frontend.url + "/v1/contexts", headers=auth, json={"messages": m[:-1]}, timeout=300)
    assert r.status_code == 201, r.text
    ctx = r.json()["id"]

    def generate(agent: str) -> dict:
        r = httpx.post(f"{frontend.url}/v1/contexts/{ctx}/generate", headers=auth, timeout=300, json={
            "agent": agent, "messages": m[-1:], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    coder, planner = generate("coder"), generate("planner")
    assert coder["timeline"]["route"] == "lora-0:longest_prefix", coder["timeline"]
    assert coder["timeline"]["transfer_bytes"] == 0 and coder["timeline"]["imported_tokens"] > 0
    assert planner["timeline"]["route"] == "node-0/lora-0:only_candidate", planner["timeline"]
    assert planner["timeline"]["transfer_bytes"] > 0 and planner["timeline"]["transfer_codec"] == "fp32"
    assert planner["timeline"]["imported_tokens"] == coder["timeline"]["imported_tokens"]
    want, _ = oracle("coder", m)
    assert want.startswith(coder["text"])  # the first 8 of the oracle's 32 tokens


def test_the_node_refuses_calls_without_the_cluster_secret(node: VllmServer) -> None:
    for headers in ({}, {HEADER: "forged"}):
        r = httpx.get(node.url + "/internal/vllm/info", headers=headers, timeout=30)
        assert r.status_code == 401, r.text
    r = httpx.post(node.url + "/internal/vllm/completions", json={"model": "coder", "prompt": [1, 2, 3]}, timeout=30)
    assert r.status_code == 401


def test_the_frontend_lists_the_nodes_agents_and_reports_them_healthy(frontend: VllmServer) -> None:
    r = httpx.get(frontend.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert {"coder", "planner"} <= {m["id"] for m in r.json()["data"]}
    health = httpx.get(frontend.url + "/health", timeout=30).json()
    assert health["status"] == "ok", health


def test_an_agent_whose_instance_here_is_down_is_served_by_the_node(frontend: VllmServer, oracle) -> None:
    """Last: the frontend's coder instance is killed; until it is back, the coder's requests go to
    the node, with the same output."""
    os.killpg(frontend.instance_pid("lora-0"), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while "vllm instance lora-0 is not serving" not in httpx.get(frontend.url + "/health", timeout=10).json()["reasons"]:
        assert time.monotonic() < deadline, "the supervisor did not notice the dead instance"
        time.sleep(0.5)
    m = messages_for("failover", "Write a function that uses os.path.")
    r = httpx.post(frontend.url + "/v1/contexts", headers={"Authorization": f"Bearer {KEYS[0]}"},
                   json={"messages": m[:-1]}, timeout=300)
    assert r.status_code == 201, r.text
    r = httpx.post(f"{frontend.url}/v1/contexts/{r.json()['id']}/generate", headers={"Authorization": f"Bearer {KEYS[0]}"},
                   json={"agent": "coder", "messages": m[-1:], "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                   timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["timeline"]["route"] == "node-0/lora-0:only_candidate", body["timeline"]
    assert body["timeline"]["imported_tokens"] > 0
    want, _ = oracle("coder", m)
    assert want.startswith(body["text"])
