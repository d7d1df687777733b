"""Nobody outside the cluster may write into its KV: the KV cache poisoning probe, reproduced
against the real router and workers.

The probe: from outside, register an expected transfer with a decode worker (``expect``),
push 4 KV blocks for a 64-token prefix, then ask the router for a prompt with that prefix.
Without authentication the answer came from the forged KV. Here every internal call needs the
cluster secret, every KV frame its HMAC; refusals are counted by the worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from server.api.tenancy import Tenancy
from server.cluster.codec import Codec, KVChunk, encode
from tests.server.cluster.conftest import ADMIN_KEY, API_KEYS, Running, bearer

# the session's cluster starts in the first test's setup (about 25 s quiet, minutes on a loaded
# machine), and the fault tests restart workers and wait for them in real time
pytestmark = pytest.mark.timeout(600)

BLOCK = 16
PREFIX = 4 * BLOCK  # the poisoned prefix: 4 blocks


def kv_shape(model_dir: Path) -> tuple[int, int, int]:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), cfg["hidden_size"] // heads


def prompt_ids() -> list[int]:
    """84 token ids no other request sent (random, fixed per call): 64 to poison, 20 more."""
    g = torch.Generator().manual_seed(uuid.uuid4().int % (1 << 62))
    return torch.randint(100, 20000, (PREFIX + 20,), generator=g).tolist()


def salt_of(key: str) -> str:
    return Tenancy(API_KEYS).authenticate(f"Bearer {key}").salt


def forged_frames(model_dir: Path, transfer_id: str) -> list[tuple[dict[str, Any], bytes]]:
    """An attacker's transfer: open, 4 blocks of large KV (fp32, as the cluster moves it), end."""
    layers, heads, dim = kv_shape(model_dir)
    k = torch.full((layers, heads, PREFIX, dim), 30.0)
    frame = encode(KVChunk(0, k, -k), Codec.FP32, block_size=BLOCK)
    return [({"kind": "open", "transfer_id": transfer_id, "codec": "fp32", "mode": "tcp", "meta": {}}, b""),
            (frame.header, bytes(frame.payload)), ({"kind": "end"}, b"")]


def push_without_hmac(address: str, frames: list[tuple[dict[str, Any], bytes]]) -> list[str]:
    """Send ``frames`` as the KV wire had them before authentication (no tag), blindly; returns
    the kinds of what the receiver answered before closing."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    replies: list[str] = []
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        try:
            for header, payload in frames:
                h = json.dumps(header).encode()
                sock.sendall(struct.pack("<4sBIQ", b"ASKV", 1, len(h), len(payload)) + h + payload)
        except OSError:
            pass  # the receiver hung up on us
        data = b""
        try:
            while chunk := sock.recv(1 << 16):
                data += chunk
        except OSError:
            pass
    while len(data) >= 17:
        _, _, hlen, plen = struct.unpack("<4sBIQ", data[:17])
        try:
            replies.append(json.loads(data[17:17 + hlen])["kind"])
        except (ValueError, KeyError):
            replies.append("?")
        data = data[17 + hlen + plen:]
        if data[:4] != b"ASKV":  # a tag, then maybe the next frame
            data = data[data.find(b"ASKV"):] if b"ASKV" in data else b""
    return replies


def push_with_wrong_key(address: str, frames: list[tuple[dict[str, Any], bytes]]) -> list[str]:
    """The real sender, with a key that is not the cluster's."""
    from server.cluster.codec import Frame
    from server.cluster.transport import TransferError, open_sender

    async def go() -> list[str]:
        try:
            sender = await open_sender(address, frames[0][0]["transfer_id"], codec=Codec.FP32, timeout=5,
                                       key=os.urandom(32))
            await sender.send(Frame(*frames[1]))
            await sender.finish()
        except TransferError as exc:
            return [f"refused: {exc}"]
        return ["ack"]

    return asyncio.run(go())


def complete(url: str, ids: list[int], key: str = API_KEYS[0]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", headers=bearer(key), timeout=120,
                   json={"model": "base", "prompt": ids, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def worker_info(cluster: Running, i: int) -> dict[str, Any]:
    return httpx.get(f"{cluster.workers.urls[i]}/internal/info", headers=cluster.internal, timeout=10).json()


def test_the_poisoned_prefix_scenario_answers_as_a_clean_server(cluster: Running, colocated: str, tiny_model_dir):
    """The probe as it was run: expect and push from outside, then the request through the router."""
    ids = prompt_ids()
    decode_url = cluster.workers.urls[1]
    address = worker_info(cluster, 1)["kv_address"]["tcp"]
    tid = f"evil-{uuid.uuid4().hex[:8]}"
    before = cluster.stats()[1]
    expect = httpx.post(f"{decode_url}/internal/kv/expect", timeout=10, json={
        "transfer_id": tid, "token_ids": ids[:PREFIX], "salt": salt_of(API_KEYS[0]), "timeout": 30.0})
    replies = push_without_hmac(address, forged_frames(tiny_model_dir, tid))
    got, want = complete(cluster.url, ids), complete(colocated, ids)
    assert got["choices"][0]["text"] == want["choices"][0]["text"], (expect.text, replies)
    assert expect.status_code == 401, expect.text
    assert "ack" not in replies
    after = cluster.stats()[1]
    assert after.get("refused_requests", 0) == before.get("refused_requests", 0) + 1
    assert after.get("refused_frames", 0) == before.get("refused_frames", 0) + 1


@pytest.mark.parametrize("forge", [push_without_hmac, push_with_wrong_key], ids=["no_hmac", "wrong_hmac"])
def test_forged_kv_frames_for_an_expected_transfer_are_refused_and_counted(
    cluster: Running, colocated: str, tiny_model_dir, forge
):
    """Even for a transfer the decode worker really expects (registered with the secret), frames
    without the HMAC, or with one under another key, are refused before anything is decoded;
    the expected blocks are never served unwritten: the request computes them itself."""
    ids = prompt_ids()
    decode_url = cluster.workers.urls[1]
    address = worker_info(cluster, 1)["kv_address"]["tcp"]
    tid = f"expected-{uuid.uuid4().hex[:8]}"
    before = cluster.stats()[1]
    r = httpx.post(f"{decode_url}/internal/kv/expect", headers=cluster.internal, timeout=10, json={
        "transfer_id": tid, "token_ids": ids[:PREFIX], "salt": salt_of(API_KEYS[0]), "timeout": 2.0})
    assert r.status_code == 200, r.text
    assert r.json()["num_blocks"] == 4
    replies = forge(address, forged_frames(tiny_model_dir, tid))
    assert "ack" not in replies, replies
    got, want = complete(cluster.url, ids), complete(colocated, ids)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    after = cluster.stats()[1]
    assert after["imported_blocks"] == before["imported_blocks"]
    assert after.get("refused_frames", 0) == before.get("refused_frames", 0) + 1
    metrics = httpx.get(f"{decode_url}/metrics", timeout=10).text
    assert f'agentshare_cluster_refused_total{{channel="kv"}} {after.get("refused_frames", 0)}.0' in metrics


@pytest.mark.parametrize(("worker", "method", "path", "body"), [
    (1, "GET", "/internal/info", None),
    (1, "GET", "/internal/stats", None),
    (1, "POST", "/internal/lookup", {"token_ids": [1, 2, 3]}),
    (1, "POST", "/internal/kv/expect", {"transfer_id": "x", "token_ids": list(range(16)), "timeout": 1.0}),
    (1, "POST", "/internal/generate", {"request_id": "x", "module": "base", "prompt": {}, "params": {}}),
    (0, "POST", "/internal/prefill", {"transfer_id": "x", "token_ids": list(range(16)), "first_block": 0,
                                      "destination": "tcp://127.0.0.1:1", "codec": "fp32"}),
    (0, "POST", "/internal/contexts", {"context_id": "x", "token_ids": [1, 2], "ttl": 1.0}),
])
def test_internal_endpoints_refuse_calls_without_the_secret(cluster: Running, worker, method, path, body):
    url = cluster.workers.urls[worker] + path
    before = cluster.stats()[worker].get("refused_requests", 0)
    for headers in ({}, {"X-Agentshare-Cluster": "0" * 64}, bearer(API_KEYS[0])):
        r = httpx.request(method, url, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.status_code, r.text)
        assert "cluster secret" in r.json()["error"]["message"]
    assert cluster.stats()[worker]["refused_requests"] == before + 3
    metrics = httpx.get(f"{cluster.workers.urls[worker]}/metrics", timeout=10).text
    assert 'agentshare_cluster_refused_total{channel="http"}' in metrics


def test_the_router_refuses_joins_without_the_secret_and_its_cluster_view_without_the_admin_key(cluster: Running):
    r = httpx.post(f"{cluster.url}/internal/workers", json={"url": "http://127.0.0.1:9"}, timeout=10)
    assert r.status_code == 401, r.text
    assert len(cluster.cluster()["workers"]) == 3  # nothing joined
    for headers in ({}, bearer(API_KEYS[0]), bearer("wrong-admin-key"), cluster.internal):
        r = httpx.get(f"{cluster.url}/internal/cluster", headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
        assert "admin key" in r.json()["error"]["message"]
        assert ADMIN_KEY not in r.text
    assert httpx.get(f"{cluster.url}/internal/cluster", headers=bearer(ADMIN_KEY), timeout=10).status_code == 200
