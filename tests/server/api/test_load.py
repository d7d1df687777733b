"""Overload, at scale: 200 concurrent requests against a small queue. Some get 429 with
Retry-After, every other one is served in full, ``/health`` answers throughout, and afterwards
no KV block is held and nothing waits. (``test_backpressure`` covers the 429 rules themselves.)

The figures (served, refused, /health latency, memory growth) are printed: ``pytest -s``.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

REQUESTS = 200
MAX_TOKENS = 8
HEALTH_BOUND_S = 2.0  # /health is served on the event loop, never queued behind generation


def gauge(metrics: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    assert m is not None, name
    return float(m[1])


BURST = """
import asyncio, json, sys
import httpx

url, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def body(i):
    return {"model": ("base", "coder", "planner")[i % 3], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": i % 4 == 0,
            "messages": [{"role": "user", "content": f"Request {i}: count to ten."}]}


async def one(c, i):
    async with c.stream("POST", "/v1/chat/completions", json=body(i)) as r:
        return [r.status_code, dict(r.headers), (await r.aread()).decode()]


async def main():
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        return await asyncio.gather(*(one(c, i) for i in range(n)))


print(json.dumps(asyncio.run(main())))
"""


@pytest.mark.timeout(180)  # 200 requests on a tiny model: ~10 s here on a loaded machine
def test_two_hundred_concurrent_requests_against_a_small_queue(start_server: Callable[..., str],
                                                                tmp_path: Path) -> None:
    """The burst comes from another process (as clients do), so /health's latency is the server's."""
    url = start_server(max_running=4, max_waiting=8)
    proc = psutil.Process()
    gc.collect()
    rss_before = proc.memory_info().rss
    health: list[float] = []
    start = time.monotonic()
    out = tmp_path / "burst.json"  # a file, not a pipe: a full pipe would block the burst
    with out.open("w") as sink:
        burst = subprocess.Popen([sys.executable, "-c", BURST, url, str(REQUESTS), str(MAX_TOKENS)], stdout=sink)
    with httpx.Client(base_url=url, timeout=30) as probe:
        while burst.poll() is None:
            t = time.monotonic()
            r = probe.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "ok", r.text
            health.append(time.monotonic() - t)
            time.sleep(0.05)
    elapsed = time.monotonic() - start
    assert burst.wait() == 0
    results = json.loads(out.read_text())
    codes = [status for status, _, _ in results]
    assert len(codes) == REQUESTS and set(codes) <= {200, 429}, sorted(set(codes))
    served, refused = codes.count(200), codes.count(429)
    assert served >= 4 and refused >= 1, (served, refused)
    for status, headers, text in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            err = json.loads(text)["error"]
            assert (err["type"], err["code"]) == ("rate_limit_error", "overloaded"), err
        elif headers["content-type"].startswith("text/event-stream"):
            chunks = [json.loads(line[6:]) for line in text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert text.rstrip().endswith("data: [DONE]") and all("error" not in ch for ch in chunks), text[-300:]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert json.loads(text)["usage"]["completion_tokens"] == MAX_TOKENS
    assert health and max(health) < HEALTH_BOUND_S, sorted(health)[-5:]

    with httpx.Client(base_url=url, timeout=30) as c:
        metrics = c.get("/metrics").text
        assert gauge(metrics, 'agentshare_kv_blocks{state="held"}') == 0
        assert gauge(metrics, "agentshare_requests_waiting") == 0 and gauge(metrics, "agentshare_requests_running") == 0
        assert gauge(metrics, 'agentshare_rejected_requests_total{reason="queue_full"}') == refused
        after = c.post("/v1/chat/completions", json={"model": "base", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "Still there?"}]})
        assert after.status_code == 200, after.text
    gc.collect()
    grown = (proc.memory_info().rss - rss_before) / 2**20
    print(f"\n{REQUESTS} concurrent requests in {elapsed:.1f} s: {served} served, {refused} refused with 429; "
          f"/health max {max(health):.3f} s, median {sorted(health)[len(health) // 2]:.3f} s over {len(health)} "
          f"probes; server memory +{grown:.0f} MiB")
    assert grown < 256, f"memory grew by {grown:.0f} MiB"
