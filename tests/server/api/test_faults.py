"""Faults against the real server (uvicorn, tiny model): the top_p request of issue 14, a request
that raises inside the engine, a stuck step. Each fails alone, with a clear error, and the
server serves on; ``/health`` says ``degraded`` while the engine is stuck.

On the old server the top_p request killed the engine thread: it, every later request and
``/health`` itself got no answer (measured: 30 s client timeouts).
"""

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from server.api.config import ServerConfig
from server.engine import output as output_module
from server.engine.async_engine import AsyncEngine
from tests.server.helpers import running_server

ISSUE_14 = {"model": "base", "messages": [{"role": "user", "content": "hello there, how are you?"}],
            "max_tokens": 4, "temperature": 1.0, "top_p": 1e-300}


def chat(url: str, timeout: float = 30, **over) -> httpx.Response:
    body = {"model": "base", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4,
            "temperature": 0, **over}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)


def health(url: str) -> dict:
    r = httpx.get(f"{url}/health", timeout=5)
    assert r.status_code == 200
    return r.json()


@pytest.fixture
def served(tiny_core) -> Iterator[Callable[..., tuple[str, AsyncEngine]]]:
    """``served(**ServerConfig fields) -> (url, engine)``: a server whose engine the test reads."""
    with contextlib.ExitStack() as stack:
        def start(**fields) -> tuple[str, AsyncEngine]:
            config = ServerConfig(kv_cache_bytes=16 << 20, default_max_tokens=16, **fields)
            engine = AsyncEngine(tiny_core.with_config(config.engine_config()))
            return stack.enter_context(running_server(engine, config)), engine

        yield start


def blocks_held(engine: AsyncEngine) -> int:
    return asyncio.run(engine.run(lambda core: core.pool.usage().held))


def test_the_issue_14_top_p_request_returns_promptly_and_the_server_serves_on(served):
    url, engine = served()
    started = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=ISSUE_14, timeout=30)
    took = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4 and took < 10
    assert health(url)["status"] == "ok"
    assert chat(url).status_code == 200
    assert blocks_held(engine) == 0


def test_a_request_that_raises_in_the_engine_fails_alone_with_a_clear_error(served, monkeypatch):
    url, engine = served()
    real = output_module.sample

    def sample(logits, params, *args, **kw):  # raises for the request that asked for seed 4242
        if any(p.seed == 4242 for p in params):
            raise RuntimeError("injected sampler failure")
        return real(logits, params, *args, **kw)

    monkeypatch.setattr(output_module, "sample", sample)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        bad = pool.submit(chat, url, seed=4242, temperature=0.7)
        good = [pool.submit(chat, url, messages=[{"role": "user", "content": f"Count to {i}."}]) for i in (3, 5)]
        bad_r, good_r = bad.result(), [g.result() for g in good]
    assert bad_r.status_code == 500
    err = bad_r.json()["error"]
    assert err["code"] == "engine_error" and "RuntimeError: injected sampler failure" in err["message"]
    assert [g.status_code for g in good_r] == [200, 200]
    assert health(url)["status"] == "ok"
    assert chat(url).status_code == 200
    assert blocks_held(engine) == 0  # the failed request's KV is back in the pool


@pytest.mark.timeout(120)  # a stall and a recovery in real time
def test_a_stuck_step_fails_its_request_health_says_degraded_and_the_server_recovers(served, monkeypatch):
    url, engine = served(step_timeout=0.5)
    release = threading.Event()
    real = output_module.sample

    def sample(logits, params, *args, **kw):  # the request with seed 777 hangs its step
        if any(p.seed == 777 for p in params):
            release.wait(60)
        return real(logits, params, *args, **kw)

    monkeypatch.setattr(output_module, "sample", sample)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(chat, url, seed=777, temperature=0.7)
            deadline = time.monotonic() + 10
            while (h := health(url))["status"] == "ok":
                assert time.monotonic() < deadline, "/health never said degraded"
                time.sleep(0.05)
            assert "0.5 s limit (step_timeout)" in h["reasons"][0]
            r = stuck.result(timeout=10)
        assert r.status_code == 500 and "ran past the 0.5 s limit" in r.json()["error"]["message"]
        refused = chat(url)
        assert refused.status_code == 503 and "retry later" in refused.json()["error"]["message"]
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while health(url)["status"] != "ok":
        assert time.monotonic() < deadline, "the engine did not recover"
        time.sleep(0.05)
    assert chat(url).status_code == 200
    assert blocks_held(engine) == 0
    assert engine.health().stalls == 1
