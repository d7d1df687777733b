"""Issue 14, defect 1, against the real disaggregated set (a router, one prefill and two decode
workers as processes, the session's ``cluster``).

On the old code the top_p request below killed the engine thread of the decode worker serving
it (its sampler raised): the request got no answer within 30 s and the router marked that worker
down; a second such request took down the other one; from then on every request got 503 while
``/health`` said ok.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx
import pytest

from tests.server.cluster.conftest import Running, bearer, fresh

ISSUE_14 = {"model": "base", "messages": [{"role": "user", "content": "hello there, how are you?"}],
            "max_tokens": 4, "temperature": 1.0, "top_p": 1e-300}


def post(url: str, body: dict[str, Any], timeout: float = 30) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", headers=bearer(), json=body, timeout=timeout)
    return r, time.monotonic() - started


def health(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/health", timeout=5)
    assert r.status_code == 200
    return r.json()


def until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def test_the_top_p_request_returns_promptly_and_both_decode_workers_stay_up(cluster: Running):
    before = cluster.stats()
    # the exact request of the issue, then the same for the agent only each decode worker
    # serves (so both workers get one for sure), then four at once
    bodies = [ISSUE_14, {**ISSUE_14, "model": "coder"}, {**ISSUE_14, "model": "planner"}]
    results = [post(cluster.url, b) for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results += list(pool.map(lambda b: post(cluster.url, b), [ISSUE_14, bodies[1], bodies[2], ISSUE_14]))
    for r, _ in results:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    assert max(took for _, took in results) < 15
    after = cluster.stats()
    assert [a["finished"] - b["finished"] >= 2 for a, b in zip(after[1:], before[1:], strict=True)] == [True, True]
    assert [w["alive"] for w in cluster.cluster()["workers"]] == [True, True, True]
    assert health(cluster.url)["status"] == "ok"
    for agent in ("base", "coder", "planner"):
        r, _ = post(cluster.url, {"model": agent, "max_tokens": 4, "temperature": 0,
                                  "messages": [{"role": "user", "content": fresh("Still there?")}]})
        assert r.status_code == 200, r.text


def test_penalties_cross_the_router_to_the_decode_worker(cluster: Running):
    """The router sends a request's sampling parameters whole: a penalty changes the greedy
    answer through the cluster as it does on one server (the same prompt as ``test_openai``'s,
    where a repeat reward moves a token by the 6th step), and an unknown knob is refused there."""
    body = {"model": "base", "messages": [{"role": "user", "content": "a a a a a a a a"}], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}
    answers = {}
    for name, extra in (("plain", {}), ("repetition", {"repetition_penalty": 0.05}),
                        ("presence", {"presence_penalty": -2.0}), ("frequency", {"frequency_penalty": -2.0})):
        r, _ = post(cluster.url, {**body, **extra})
        assert r.status_code == 200, r.text
        answers[name] = r.json()["choices"][0]["message"]["content"]
    assert all(answers[k] != answers["plain"] for k in ("repetition", "presence", "frequency")), answers
    r, _ = post(cluster.url, {**body, "min_p": 0.1})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "min_p")


@pytest.mark.timeout(240)  # a worker is killed and restarted (about 25 s on a loaded machine)
def test_router_health_is_degraded_while_an_agent_has_no_decode_worker_up(fault_cluster: Running):
    until(lambda: health(fault_cluster.url)["running"] == 0, "the previous test's requests end")
    h = health(fault_cluster.url)
    assert (h["status"], h["reasons"]) == ("ok", [])
    fault_cluster.workers.kill(2)  # the planner's only decode worker ("base" is on worker 1 too)
    try:
        until(lambda: health(fault_cluster.url)["status"] == "degraded", "the router reports degraded")
        assert health(fault_cluster.url)["reasons"] == ["no decode worker serving agent 'planner' is up"]
        r, _ = post(fault_cluster.url, {**ISSUE_14, "model": "coder"})
        assert r.status_code == 200, r.text  # the other agents are still served
    finally:
        fault_cluster.workers.restart(2)
        fault_cluster.workers.wait_ready()
    until(lambda: health(fault_cluster.url)["status"] == "ok", "the restarted worker rejoins")
    assert health(fault_cluster.url)["reasons"] == []
