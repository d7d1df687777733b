"""The colocated server's token counters end to end, read from ``/metrics`` (as the SDK's
:class:`~agentshare.metrics.ServerMetrics` reads them), exactly, on a fixed script of requests:
every prompt token counted once, ``prompt = computed + reused + imported`` (nothing is imported
in one process). Each case has a server of its own (an empty cache); ``P`` is the shared
prefix: the full blocks before the agents' turn."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from agentshare.metrics import ServerMetrics
from server.prompt import Placement, Prompt, chat_prompt

BS = 16
KEYS = ("tenant-key-a-0123456789", "tenant-key-b-0123456789", "tenant-key-c-0123456789")
DOC = "Shared notes: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(30))
QUESTIONS = {"coder": "Write the code for item 4.", "planner": "Plan around item 9, briefly.",
             "base": "Review items 1 to 3."}


@pytest.fixture
def server(start_server: Callable[..., str]) -> str:
    return start_server(api_keys=KEYS)


def metrics(url: str) -> ServerMetrics:
    return ServerMetrics.parse(httpx.get(f"{url}/metrics", timeout=10).text)


def ask(url: str, agent: str, doc: str, *, key: str = KEYS[0]) -> int:
    """One chat request; its prompt tokens."""
    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60, json={
        "model": agent, "temperature": 0, "max_tokens": 4,
        "messages": [{"role": "user", "content": doc}, {"role": "user", "content": QUESTIONS[agent]}]})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def prompt_of(tok, agent: str, doc: str) -> Prompt:
    return chat_prompt(tok, [{"role": "user", "content": doc}], [{"role": "user", "content": QUESTIONS[agent]}])


def counted(m: ServerMetrics) -> tuple[int, int, int, int, int]:
    return m.prompt_tokens, m.computed_tokens, m.reused_tokens, m.imported_tokens, m.exported_tokens


def test_three_agents_read_the_shared_prefix_computed_once(server, smollm2_tokenizer):
    prompts = {a: prompt_of(smollm2_tokenizer, a, DOC) for a in QUESTIONS}
    n = {a: len(p.token_ids) for a, p in prompts.items()}
    p = prompts["coder"].invocation_point(Placement.TURN) // BS * BS
    assert p >= 128 and all(v % BS for v in n.values())
    before = metrics(server)
    for agent in QUESTIONS:  # the base reads the same family blocks of the context
        assert ask(server, agent, DOC) == n[agent]
    spent = metrics(server) - before
    assert counted(spent) == (sum(n.values()), sum(n.values()) - 2 * p, 2 * p, 0, 0)
    assert (spent.prefill_computed_tokens, spent.prefill_cached_tokens) == (sum(n.values()) - 2 * p, 2 * p)


def test_three_tenants_with_the_same_prompt_share_nothing(server, smollm2_tokenizer):
    n = len(prompt_of(smollm2_tokenizer, "coder", DOC).token_ids)
    before = metrics(server)
    for key in KEYS:
        assert ask(server, "coder", DOC, key=key) == n
    assert counted(metrics(server) - before) == (3 * n, 3 * n, 0, 0, 0)


def test_a_request_with_nothing_cached_computes_its_whole_prompt(server, smollm2_tokenizer):
    n = len(prompt_of(smollm2_tokenizer, "planner", "A short note.").token_ids)
    before = metrics(server)
    assert ask(server, "planner", "A short note.") == n
    assert counted(metrics(server) - before) == (n, n, 0, 0, 0)
