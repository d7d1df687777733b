"""The router's token counters end to end (one prefill and two decode workers, conftest's
``cluster``), read from its ``/metrics`` through the SDK's :class:`ServerMetrics`, exactly:

    prompt tokens (once per request) = computed (decode role) + reused + imported

and what the prefill worker computed for the decode workers apart (role prefill). Each request
starts with a system message of its own, so no block of it is cached anywhere before; figures
come from the prompts' lengths and the block size (and, where they depend on it, on which decode
worker the router chose, read from the workers' own counters)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from agentshare.metrics import ServerMetrics
from server.prompt import Placement, Prompt, chat_prompt
from tests.server.cluster.conftest import API_KEYS, Running, bearer

pytestmark = pytest.mark.timeout(600)  # the session's cluster may start in this module's first test

BS = 16
THRESHOLD = 64  # conftest's --offload-threshold: a prefill of more new tokens is offloaded
DOC = "Shared notes: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(30))
QUESTIONS = {"coder": "Write the code for item 4.", "planner": "Plan around item 9, briefly.",
             # long enough that its full blocks past the shared ones are always offloaded (> 64 new)
             "base": "Review items 1 to 3. " + " ".join(f"Then say what item {i} is." for i in range(12))}


class Script:
    """Messages of one case, their prompts as the server lays them out, and the metrics."""

    def __init__(self, tok: Any) -> None:
        self.system = f"[{uuid.uuid4().hex}] You help with notes."
        self.tok = tok

    def messages(self, agent: str, doc: str = DOC) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": doc},
                {"role": "user", "content": QUESTIONS[agent]}]

    def prompt(self, agent: str, doc: str = DOC) -> Prompt:
        m = self.messages(agent, doc)
        return chat_prompt(self.tok, m[:-1], m[-1:])


def metrics(cluster: Running) -> ServerMetrics:
    return ServerMetrics.parse(httpx.get(f"{cluster.url}/metrics", timeout=10).text)


def ask(cluster: Running, agent: str, messages: list[dict[str, str]], *, key: str = API_KEYS[0]) -> tuple[int, int]:
    """One chat request through the router; (its prompt tokens, its cached tokens)."""
    r = httpx.post(f"{cluster.url}/v1/chat/completions", headers=bearer(key), timeout=120, json={
        "model": agent, "temperature": 0, "max_tokens": 4, "messages": messages})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def served_by(cluster: Running, before: list[dict[str, Any]]) -> int:
    """The decode worker (1 or 2) whose prompt tokens grew since ``before``."""
    after = cluster.stats()
    grew = [i for i in (1, 2) if after[i]["prompt_tokens"] > before[i]["prompt_tokens"]]
    assert len(grew) == 1 and after[0]["prompt_tokens"] == before[0]["prompt_tokens"], grew
    return grew[0]


def counted(m: ServerMetrics) -> dict[str, int]:
    return {"prompt": m.prompt_tokens, "computed": m.computed_tokens, "reused": m.reused_tokens,
            "imported": m.imported_tokens, "prefill_computed": m.exported_tokens}


def test_three_agents_on_one_prefix_count_every_prompt_token_once(cluster: Running, smollm2_tokenizer):
    for _ in range(100):  # a fresh system message (its random tag tokenizes to varying lengths)
        script = Script(smollm2_tokenizer)
        prompts = {a: script.prompt(a) for a in QUESTIONS}
        n = {a: len(p.token_ids) for a, p in prompts.items()}
        p = prompts["coder"].invocation_point(Placement.TURN) // BS * BS  # the LoRA agents' shared blocks
        fb = n["base"] // BS * BS  # the base's: every full block of its prompt (its IP is the prompt's end)
        if all(v % BS for v in n.values()):  # no prompt ends on a block boundary: the figures below hold
            break
    assert p >= 256 and fb - p > THRESHOLD and all(v % BS for v in n.values())
    decisions = cluster.cluster()["decisions"]
    before = metrics(cluster)
    expect = {"prompt": 0, "computed": 0, "reused": 0, "imported": 0, "prefill_computed": fb}
    holds_p: set[int] = set()  # decode workers holding the shared blocks
    offloaded = cached = 0
    for agent in QUESTIONS:
        stats = cluster.stats()
        got, cached_here = ask(cluster, agent, script.messages(agent))
        worker = served_by(cluster, stats)
        assert got == n[agent]
        cached += cached_here
        share, have = (fb if agent == "base" else p), (p if worker in holds_p else 0)
        new = share - have
        expect["prompt"] += n[agent]
        expect["reused"] += have
        if new > THRESHOLD:  # offloaded: the blocks it lacks are imported
            offloaded += 1
            expect["imported"] += new
            expect["computed"] += n[agent] - share
        else:  # kept local: computed by its decode worker
            expect["computed"] += n[agent] - have
        holds_p.add(worker)
    spent = counted(metrics(cluster) - before)
    assert spent == expect
    assert spent["prompt"] == spent["computed"] + spent["reused"] + spent["imported"]
    assert cached == spent["reused"] + spent["imported"] <= spent["prompt"]  # the per-request usage agrees
    now = cluster.cluster()["decisions"]
    assert now.get("offloaded", 0) - decisions.get("offloaded", 0) == offloaded >= 2  # the coder's and the base's


def test_two_tenants_with_the_same_prompt_each_move_their_own_prefix(cluster: Running, smollm2_tokenizer):
    script = Script(smollm2_tokenizer)
    prompt = script.prompt("coder")
    n, p = len(prompt.token_ids), prompt.invocation_point(Placement.TURN) // BS * BS
    before, stats = metrics(cluster), cluster.stats()
    for key in API_KEYS:  # conftest's two tenants (three: tests/server/cluster/test_counters.py)
        assert ask(cluster, "coder", script.messages("coder"), key=key)[0] == n
    spent = counted(metrics(cluster) - before)
    assert spent == {"prompt": 2 * n, "computed": 2 * (n - p), "reused": 0, "imported": 2 * p,
                     "prefill_computed": 2 * p}
    # over the links: the same tokens, in the codec the router sends (conftest: fp32), and their bytes
    after = cluster.stats()
    moved = sum(a["imported_tokens"].get("fp32", 0) - b["imported_tokens"].get("fp32", 0)
                for a, b in zip(after[1:], stats[1:], strict=True))
    received = sum(link["bytes"] for s in after[1:] for link in s["received"].values()) - \
        sum(link["bytes"] for s in stats[1:] for link in s["received"].values())
    assert moved == 2 * p and received >= moved * 3072  # fp32 KV of the tiny model: 3072 bytes a token
    assert 'agentshare_kv_imported_tokens_total{codec="fp32"' in httpx.get(f"{cluster.url}/metrics", timeout=10).text


def test_a_request_kept_local_while_the_prefill_worker_holds_its_prefix(cluster: Running, smollm2_tokenizer):
    """A context pinned through the router lives on the prefill worker; a request on it whose
    shared blocks are under the offload threshold is kept local (``below_threshold``): its decode
    worker computes them again, counted as computed by the decode role, and the route reason says
    why. The context itself is a request (its prompt tokens, computed where it is pinned)."""
    doc = f"[{uuid.uuid4().hex}] A short note."
    ctx = httpx.post(f"{cluster.url}/v1/contexts", headers=bearer(), timeout=60, json={"text": doc}).json()
    assert BS <= ctx["pinned_tokens"] <= THRESHOLD  # whole blocks held by the prefill worker, under the threshold
    decisions = cluster.cluster()["decisions"]
    before = metrics(cluster)
    stats = cluster.stats()
    assert stats[0]["contexts"] >= 1  # pinned on the prefill worker
    r = httpx.post(f"{cluster.url}/v1/contexts/{ctx['id']}/generate", headers=bearer(), timeout=120, json={
        "agent": "coder", "text": "Summarize it.", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    served_by(cluster, stats)
    n = r.json()["usage"]["prompt_tokens"]
    assert n > ctx["tokens"] and r.json()["usage"]["cached_tokens"] == 0
    spent = counted(metrics(cluster) - before)
    assert spent == {"prompt": n, "computed": n, "reused": 0, "imported": 0, "prefill_computed": 0}
    now = cluster.cluster()["decisions"]
    assert now.get("below_threshold", 0) - decisions.get("below_threshold", 0) == 1
    assert httpx.delete(f"{cluster.url}/v1/contexts/{ctx['id']}", headers=bearer(), timeout=30).json()["released"]
