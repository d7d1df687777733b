"""Health, metrics, logs without prompt text, and client disconnects that free KV."""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import pytest

from server.api.logs import JsonFormatter

MESSAGES = [{"role": "user", "content": "Context for the operations test. " * 10},
            {"role": "user", "content": "Go on."}]


def gauge(url: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", httpx.get(url + "/metrics").text, re.MULTILINE)
    assert m, name
    return float(m.group(1))


def wait_idle(url: str, timeout: float = 5.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        h = httpx.get(url + "/health").json()
        if h["running"] == 0 and h["waiting"] == 0 and gauge(url, 'agentshare_kv_blocks{state="held"}') == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError("the server did not free the request's KV")


def test_health_and_metrics(server_url: str) -> None:
    h = httpx.get(server_url + "/health").json()
    assert h["status"] == "ok" and h["agents"] == 3 and len(h["family"]) == 64
    for agent in ("coder", "planner"):
        httpx.post(server_url + "/v1/chat/completions", timeout=60,
                   json={"model": agent, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    text = httpx.get(server_url + "/metrics").text
    for name in ('agentshare_prefill_tokens_total{source="computed"}', 'agentshare_prefill_tokens_total{source="cached"}',
                 'agentshare_cache_blocks_total{outcome="cross_module_hit"}', "agentshare_kv_evictions_total",
                 "agentshare_requests_waiting", "agentshare_requests_running", 'agentshare_kv_blocks{state="free"}',
                 "agentshare_kv_occupancy", "agentshare_contexts_pinned"):
        assert name in text, name
    assert re.search(r'agentshare_time_to_first_token_seconds_count\{agent="coder"\} [1-9]', text)
    assert re.search(r'agentshare_inter_token_latency_seconds_count\{agent="planner"\} [1-9]', text)
    assert gauge(server_url, 'agentshare_cache_blocks_total{outcome="cross_module_hit"}') > 0
    assert 'agentshare_requests_total{endpoint="/v1/chat/completions",status="200"}' in text


def test_logs_carry_figures_not_prompts(server_url: str, caplog: pytest.LogCaptureFixture) -> None:
    secret = "zebra-quartz-secret-phrase"
    with caplog.at_level(logging.INFO, logger="agentshare.api"):
        r = httpx.post(server_url + "/v1/chat/completions", timeout=60,
                       json={"model": "base", "messages": [{"role": "user", "content": secret}], "max_tokens": 2})
        assert r.status_code == 200
        time.sleep(0.1)
    lines = [JsonFormatter().format(rec) for rec in caplog.records]
    requests = [json.loads(ln) for ln in lines if '"event": "request"' in ln]
    assert any(rq.get("endpoint") == "/v1/chat/completions" and rq.get("prompt_tokens", 0) > 0
               and rq.get("status") == 200 and "latency_ms" in rq for rq in requests), lines
    assert not any(secret in ln for ln in lines)


def test_stream_disconnect_cancels_and_frees_kv(server_url: str) -> None:
    wait_idle(server_url)
    body = {"model": "coder", "messages": MESSAGES, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server_url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
        assert httpx.get(server_url + "/health").json()["running"] == 1
    assert wait_idle(server_url) < 5


def test_plain_request_disconnect_cancels_and_frees_kv(server_url: str) -> None:
    wait_idle(server_url)
    body = {"model": "planner", "messages": MESSAGES, "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server_url + "/v1/chat/completions", json=body, timeout=0.5)
    assert wait_idle(server_url) < 5


def test_a_native_generation_reports_its_timeline_and_the_histograms_use_vllms_buckets(server_url: str) -> None:
    ctx = httpx.post(server_url + "/v1/contexts", timeout=60, json={"text": "Timeline context. " * 20}).json()
    body = {"agent": "coder", "text": " Go on.", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    gen = httpx.post(f"{server_url}/v1/contexts/{ctx['id']}/generate", timeout=60, json=body).json()
    t, usage = gen["timeline"], gen["usage"]
    assert t["route"] == "colocated" and t["prefill"] == "local" and t["transfer_bytes"] == 0
    assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["e2e_s"]
    assert t["decode_steps"] == usage["completion_tokens"] - 1 == 3
    assert (t["computed_tokens"], t["reused_tokens"], t["imported_tokens"]) == (
        usage["computed_tokens"], usage["cached_tokens"], 0)
    assert t["reused_tokens"] > 0  # the pinned context
    with httpx.stream("POST", f"{server_url}/v1/contexts/{ctx['id']}/generate", timeout=60,
                      json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["timeline"] is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["timeline"]["route"] == "colocated"
    text = httpx.get(server_url + "/metrics").text
    assert re.search(r'agentshare_request_queue_time_seconds_count\{agent="coder"\} [1-9]', text)
    for name, le in (("time_to_first_token", "0.001"), ("inter_token_latency", "0.025"),
                     ("e2e_request_latency", "7680.0"), ("request_queue_time", "0.3")):
        assert f'agentshare_{name}_seconds_bucket{{agent="coder",le="{le}"}}' in text, name
    assert "# TYPE agentshare_kv_transfer_time_seconds histogram" in text
