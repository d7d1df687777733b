"""Tenants through the cluster: the router serves two API keys; each key's KV is its own on
every worker (the cache salt travels with every lookup, expect, prefill and generate).

Which worker computes what depends on the router's placement; what holds whatever it picks:
a tenant never hits another's blocks, and a tenant's prefix computed once serves it on
another decode worker."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.cluster.conftest import API_KEYS, Running, bearer, fresh
from tests.server.cluster.test_cluster import DOC, QUESTION, chat

# the session's cluster starts in the first test's setup (about 25 s quiet, minutes on a loaded
# machine), and the fault tests restart workers and wait for them in real time
pytestmark = pytest.mark.timeout(600)

A, B = API_KEYS


def explain(url: str, agent: str, doc: str, key: str) -> int:
    """Tokens of the chat request (``doc``, then the agent's question) the cache holds for ``key``."""
    r = httpx.post(f"{url}/v1/explain", headers=bearer(key), timeout=60, json={
        "agent": agent, "messages": [{"role": "user", "content": doc}, {"role": "user", "content": QUESTION[agent]}]})
    assert r.status_code == 200, r.text
    return int(r.json()["cached_tokens"])


def computed(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> int:
    """Prompt tokens computed over every worker between two readings."""
    return sum(a["prefill_tokens"] - b["prefill_tokens"] for a, b in zip(after, before, strict=True))


def text(response: dict[str, Any]) -> str:
    return str(response["choices"][0]["message"]["content"])


def test_two_tenants_with_the_same_prompt_get_zero_cross_hits(cluster: Running):
    doc, other = fresh(DOC), fresh(DOC)  # ``other``: never sent by anyone
    first = chat(cluster.url, "coder", doc, key=A)
    assert explain(cluster.url, "coder", doc, A) >= explain(cluster.url, "coder", other, A) + 256  # A hits
    # for B, the prompt A just sent is as cold as one nobody sent
    assert explain(cluster.url, "coder", doc, B) == explain(cluster.url, "coder", other, B)
    before = cluster.stats()
    second = chat(cluster.url, "coder", doc, key=B)
    after = cluster.stats()
    assert computed(before, after) >= 256  # B's prefix was computed again, for B
    assert text(second) == text(first)  # the same model: the same answer, from its own KV
    assert explain(cluster.url, "coder", doc, B) >= explain(cluster.url, "coder", other, B) + 256


def test_the_same_tenant_hits_across_decode_workers(cluster: Running, colocated: str):
    """The coder (decode worker 1) and then the planner (decode worker 2), same tenant, same
    context: the first request's prefix is computed by the prefill worker (the session's router
    offloads every long prefill), so the second computes only its own suffix; the other tenant
    asking the planner the same computes the prefix again."""
    doc = fresh(DOC)
    chat(cluster.url, "coder", doc, key=A)
    before = cluster.stats()
    planner = chat(cluster.url, "planner", doc, key=A)
    mid = cluster.stats()
    assert planner["usage"]["prompt_tokens"] > 300
    # the suffix (the planner's turn, and the partial block before it) is under 64 tokens: the
    # prefix was reused, from the prefill worker's cache or moved, not computed again
    assert computed(before, mid) < 64
    assert text(planner) == text(chat(colocated, "planner", doc, key=A))
    other = chat(cluster.url, "planner", doc, key=B)
    assert computed(mid, cluster.stats()) >= 256
    assert text(other) == text(planner)
