"""Agents of one family share prefill, across the OpenAI API and the native API."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import httpx
import openai
import pytest

CONTEXT = "Shared task and documents. " + "The table has columns id, name, owner and status. " * 20
MESSAGES = [{"role": "user", "content": CONTEXT}]


def ask(url: str, agent: str, question: str, max_tokens: int = 8) -> tuple[str, int, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    res = client.chat.completions.create(model=agent, temperature=0, max_tokens=max_tokens,
                                         messages=[*MESSAGES, {"role": "user", "content": question}])
    assert res.usage is not None and res.usage.prompt_tokens_details is not None
    return res.choices[0].message.content or "", res.usage.prompt_tokens, res.usage.prompt_tokens_details.cached_tokens


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_second_agent_reads_the_first_agents_prefill(start_server: Callable[..., str]) -> None:
    url = start_server()
    _, prompt_tokens, cached = ask(url, "coder", "Which columns?")
    assert cached == 0
    answer, prompt_tokens2, cached2 = ask(url, "planner", "Which columns?")
    assert prompt_tokens2 == prompt_tokens
    # the whole shared context is served from cache; its last partial block and the turn are not
    assert cached2 >= prompt_tokens - 32 and cached2 >= 0.8 * prompt_tokens
    assert metric(url, 'agentshare_cache_blocks_total{outcome="cross_module_hit"}') > 0
    assert metric(url, 'agentshare_prefill_tokens_total{source="cached"}') >= cached2
    fresh = start_server()
    fresh_answer, _, fresh_cached = ask(fresh, "planner", "Which columns?")
    assert fresh_cached == 0 and fresh_answer == answer


@pytest.fixture(scope="module")
def native(server_url: str) -> httpx.Client:
    with httpx.Client(base_url=server_url, timeout=60) as c:
        yield c


def test_agents_list_their_families(native: httpx.Client) -> None:
    body = native.get("/v1/agents").json()
    assert len(body["family"]) == 64
    agents = {a["name"]: a for a in body["data"]}
    assert set(agents) == {"base", "coder", "planner"}
    assert all(a["family"] == body["family"] and a["shares_prefill"] for a in agents.values())
    assert agents["coder"]["kind"] == "lora" and agents["base"]["kind"] == "base"


def test_context_create_generate_extend_release(native: httpx.Client) -> None:
    r = native.post("/v1/contexts", json={"messages": MESSAGES, "ttl": 60})
    assert r.status_code == 201, r.text
    ctx = r.json()
    assert ctx["computed_tokens"] + ctx["cached_tokens"] == ctx["tokens"] and ctx["pinned_tokens"] <= ctx["tokens"]
    cid = ctx["id"]
    gens = {}
    for agent in ("coder", "planner"):
        r = native.post(f"/v1/contexts/{cid}/generate",
                        json={"agent": agent, "messages": [{"role": "user", "content": "List columns."}],
                              "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        gens[agent] = r.json()
        assert gens[agent]["usage"]["cached_tokens"] >= ctx["pinned_tokens"]
    # the native answer is the OpenAI answer (same canonical layout)
    openai_answer = ask(str(native.base_url).rstrip("/"), "coder", "List columns.", max_tokens=5)[0]
    assert gens["coder"]["text"] == openai_answer

    # streamed native generation gives the same text
    with native.stream("POST", f"/v1/contexts/{cid}/generate",
                       json={"agent": "planner", "messages": [{"role": "user", "content": "List columns."}],
                             "max_tokens": 5, "temperature": 0, "stream": True}) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(c["text"] for c in chunks) == gens["planner"]["text"]
    assert [c["finish_reason"] is not None for c in chunks].count(True) == 1 and chunks[-1]["usage"]

    r = native.post(f"/v1/contexts/{cid}/extend",
                    json={"messages": [{"role": "assistant", "content": "Observation: " + "ok. " * 30}]})
    assert r.status_code == 200, r.text
    ext = r.json()
    assert ext["tokens"] > ctx["tokens"]
    assert ext["cached_tokens"] >= ctx["pinned_tokens"]  # only the new part is prefilled
    assert ext["computed_tokens"] <= ext["tokens"] - ctx["pinned_tokens"]

    exp = native.post("/v1/explain", json={"agent": "planner", "context_id": cid, "text": "What next?"}).json()
    assert exp["cached_tokens"] >= ext["pinned_tokens"] and exp["cached_blocks"] <= exp["blocks"]

    assert native.delete(f"/v1/contexts/{cid}").json()["released"] is True
    assert native.get(f"/v1/contexts/{cid}").status_code == 404
    r = native.post(f"/v1/contexts/{cid}/generate", json={"agent": "coder", "text": "x"})
    assert r.status_code == 404 and "context" in r.json()["error"]["message"]


def test_text_contexts(native: httpx.Client) -> None:
    ctx = native.post("/v1/contexts", json={"text": CONTEXT}).json()
    r = native.post(f"/v1/contexts/{ctx['id']}/generate", json={"agent": "coder", "text": " Answer:", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["cached_tokens"] >= ctx["pinned_tokens"]
    r = native.post(f"/v1/contexts/{ctx['id']}/extend", json={"text": " More text."})
    assert r.status_code == 200 and r.json()["computed_tokens"] < 32
    r = native.post(f"/v1/contexts/{ctx['id']}/generate", json={"agent": "coder", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 422


def test_explain_says_where_a_request_stops_hitting(native: httpx.Client) -> None:
    msgs = [{"role": "system", "content": "Agent-specific system prompt first. " * 4}, *MESSAGES,
            {"role": "user", "content": "Q?"}]
    before = native.post("/v1/explain", json={"agent": "coder", "messages": msgs}).json()
    assert before["cached_blocks"] == 0 and before["first_miss_block"] == 0 and before["first_miss_token"] == 0
    native.post("/v1/chat/completions", json={"model": "planner", "messages": msgs, "max_tokens": 1})
    after = native.post("/v1/explain", json={"agent": "coder", "messages": msgs}).json()
    assert after["cached_blocks"] > 0 and after["cached_tokens"] == after["cached_blocks"] * after["block_size"]
    assert after["first_miss_block"] is None or after["first_miss_block"] == after["cached_blocks"]
    other = native.post("/v1/explain", json={"agent": "coder", "prompt": "unrelated text " * 10}).json()
    assert other["cached_blocks"] == 0
