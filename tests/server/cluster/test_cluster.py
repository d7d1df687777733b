"""The disaggregated server end to end: a router, one prefill worker and two decode workers as
real processes on loopback (tiny model, fp32, one thread each), against the colocated server.

The set (``cluster``, conftest) lives for the session; each test sends prompts of its own
(``fresh``) and compares counters before and after, so it passes alone and in any order."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.cluster.conftest import ADMIN_KEY, API_KEYS, Running, bearer, fresh

# the session's cluster starts in the first test's setup (about 25 s quiet, minutes on a loaded
# machine), and the fault tests restart workers and wait for them in real time
pytestmark = pytest.mark.timeout(600)

DOC = "Shared notes: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))
QUESTION = {"coder": "Write the code for item 4.", "planner": "Plan around item 9."}


def chat(url: str, agent: str, doc: str, *, max_tokens: int = 10, key: str = API_KEYS[0]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", headers=bearer(key), timeout=120, json={
        "model": agent, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": doc}, {"role": "user", "content": QUESTION[agent]}]})
    assert r.status_code == 200, r.text
    return r.json()


def both(url: str, doc: str) -> dict[str, dict[str, Any]]:
    """Both agents at once (so the router sees two requests for one prefix together)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {a: pool.submit(chat, url, a, doc) for a in QUESTION}
        return {a: f.result() for a, f in futures.items()}


def delta(after: list[dict], before: list[dict], key: str) -> list[int]:
    return [a[key] - b[key] for a, b in zip(after, before, strict=True)]


def test_outputs_equal_the_colocated_server_and_the_prefix_is_prefilled_once(cluster: Running, colocated: str):
    doc = fresh(DOC)
    before = cluster.stats()
    got = both(cluster.url, doc)
    after = cluster.stats()
    want = {a: chat(colocated, a, doc) for a in QUESTION}
    for agent in QUESTION:
        assert got[agent]["choices"][0]["message"]["content"] == want[agent]["choices"][0]["message"]["content"]
        for k in ("prompt_tokens", "completion_tokens"):
            assert got[agent]["usage"][k] == want[agent]["usage"][k]
    computed = delta(after, before, "prefill_tokens")
    # each decode worker computed only its own suffix: the whole shared prefix (the full blocks
    # before the agents' turn, the same for both) came from its cache or the prefill worker
    reused = [delta(after, before, "prompt_tokens")[i] - computed[i] for i in (1, 2)]
    prefix = reused[0]
    assert reused == [prefix, prefix] and prefix >= 256 and prefix % 16 == 0
    # the prefill worker computed it once, for two agents on two decode workers (less any head,
    # such as the system prompt's block, it had cached before)
    assert 256 <= computed[0] <= prefix
    imported = [after[i]["imported_blocks"] - before[i]["imported_blocks"] for i in (1, 2)]
    assert after[0]["exported_blocks"] - before[0]["exported_blocks"] == sum(imported)
    assert all(after[i]["transfers_failed"] == before[i]["transfers_failed"] for i in (1, 2))
    # bytes: what the prefill worker sent is what the decode workers received (fp32 KV of the
    # tiny model: 2 (K, V) x 3 layers x 2 heads x 64 x 4 bytes per token, plus framing)
    sent = sum(link["bytes"] for link in after[0]["sent"].values()) - \
        sum(link["bytes"] for link in before[0]["sent"].values())
    received = sum(link["bytes"] for s in after[1:] for link in s["received"].values()) - \
        sum(link["bytes"] for s in before[1:] for link in s["received"].values())
    assert sent == received >= sum(imported) * 16 * 3072


def test_a_context_pinned_through_the_router_is_computed_once_for_every_agent(cluster: Running, colocated: str):
    doc = fresh(DOC + " Context two.")

    def run(url: str) -> dict[str, list[int]]:
        ctx = httpx.post(f"{url}/v1/contexts", headers=bearer(), timeout=60, json={"text": doc}).json()
        out = {}
        for agent in QUESTION:
            r = httpx.post(f"{url}/v1/contexts/{ctx['id']}/generate", headers=bearer(), timeout=120, json={
                "agent": agent, "text": QUESTION[agent], "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            out[agent] = r.json()["token_ids"]
        assert httpx.delete(f"{url}/v1/contexts/{ctx['id']}", headers=bearer(), timeout=30).json()["released"]
        return out

    before = cluster.stats()
    got = run(cluster.url)
    after = cluster.stats()
    assert got == run(colocated)
    computed = delta(after, before, "prefill_tokens")
    ctx_tokens = computed[0]  # the context, once, by the prefill worker (when it was pinned)
    assert ctx_tokens > 256
    for i in (1, 2):
        assert after[i]["imported_blocks"] > before[i]["imported_blocks"]
        assert computed[i] < delta(after, before, "prompt_tokens")[i] - 256


def test_the_sdk_works_unchanged_against_the_router(cluster: Running, colocated: str):
    """The SDK's shared context and fork, pointed at the router: one context, two agents on two
    decode workers, the same tokens as the colocated server; explain reports the moved prefix."""
    import anyio

    from agentshare import Agent, AsyncClient

    doc = fresh("SDK. " + DOC)

    async def team(url: str) -> tuple[dict[str, tuple[int, ...]], int]:
        async with AsyncClient(url, api_key=API_KEYS[0]) as client, await client.context(doc) as ctx:
            result = await ctx.fork([Agent(a, instruction=q) for a, q in QUESTION.items()],
                                    max_tokens=6, temperature=0)
            report = await client.explain("coder", [{"role": "user", "content": doc},
                                                    {"role": "user", "content": "next"}])
            return {a.agent: a.token_ids for a in result}, report.cached_tokens

    got, cached = anyio.run(team, cluster.url)
    want, _ = anyio.run(team, colocated)
    assert got == want
    assert cached >= 256  # the coder's decode worker holds the moved prefix


def test_the_router_reports_its_workers_and_decisions(cluster: Running):
    """``/internal/cluster`` counts this test's own request: one routing decision more, and
    (a long prefix never seen) an offload; the workers' counters are there too."""
    before = cluster.cluster()["decisions"]
    chat(cluster.url, "coder", fresh("Reported. " + DOC))
    info = cluster.cluster()
    assert [w["role"] for w in info["workers"]] == ["prefill", "decode", "decode"]
    assert all(w["alive"] for w in info["workers"])
    assert sum(info["decisions"].values()) == sum(before.values()) + 1
    assert info["decisions"].get("offloaded", 0) == before.get("offloaded", 0) + 1
    assert info["workers"][1]["stats"]["imported_blocks"] >= 16
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert "agentshare_prefill_tokens_total" in metrics


def test_the_router_keeps_a_short_prefill_local_and_offloads_a_long_one(cluster: Running):
    """The placement policy (server.policy.place) in the real router: a prefix whose incremental
    prefill is under the threshold (64 tokens here) is computed by the decode worker itself;
    a long one is offloaded to the prefill worker and moved."""
    decisions = cluster.cluster()["decisions"]
    before = cluster.stats()
    chat(cluster.url, "coder", fresh("A short note."))
    mid = cluster.stats()
    assert mid[0]["prefill_tokens"] == before[0]["prefill_tokens"]  # the prefill worker did nothing
    assert mid[0]["exported_blocks"] == before[0]["exported_blocks"]
    assert mid[1]["imported_blocks"] == before[1]["imported_blocks"]
    assert mid[1]["prefill_tokens"] > before[1]["prefill_tokens"]
    chat(cluster.url, "coder", fresh("A long note. " + DOC))
    after = cluster.stats()
    assert after[0]["prefill_tokens"] - mid[0]["prefill_tokens"] >= 256
    assert after[1]["imported_blocks"] - mid[1]["imported_blocks"] >= 16
    now = cluster.cluster()["decisions"]
    assert now.get("below_threshold", 0) == decisions.get("below_threshold", 0) + 1
    assert now.get("offloaded", 0) == decisions.get("offloaded", 0) + 1
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert f'agentshare_route_decisions_total{{reason="offloaded"}} {now["offloaded"]}.0' in metrics
    assert 'agentshare_workers{role="decode",state="up"} 2.0' in metrics


def test_an_offloaded_generation_reports_its_route_and_transfer_in_its_timeline(cluster: Running):
    """The native API through the router: a context pinned on the prefill worker, then a turn on
    a decode worker that lacks it: the blocks cross the link, and the timeline says so."""
    ctx = httpx.post(f"{cluster.url}/v1/contexts", headers=bearer(), timeout=120,
                     json={"text": fresh("A long context. " + DOC)})
    assert ctx.status_code == 201, ctx.text
    r = httpx.post(f"{cluster.url}/v1/contexts/{ctx.json()['id']}/generate", headers=bearer(), timeout=120,
                   json={"agent": "coder", "text": " Go on.", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    t, usage = r.json()["timeline"], r.json()["usage"]
    assert (t["route"], t["prefill"]) == ("offloaded", cluster.workers.urls[0])
    assert t["imported_tokens"] >= 256 and t["transfer_bytes"] > 0 and t["transfer_codec"]
    assert t["computed_tokens"] + t["reused_tokens"] + t["imported_tokens"] == usage["prompt_tokens"]
    assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["e2e_s"] and t["decode_steps"] == 3 and t["route_s"] > 0
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert "agentshare_kv_transfer_time_seconds_count{codec=" in metrics


def test_a_decode_worker_killed_is_skipped_and_rejoins_when_back(fault_cluster: Running):
    fault_cluster.workers.kill(2)  # the planner's only worker
    r = httpx.post(f"{fault_cluster.url}/v1/chat/completions", headers=bearer(), timeout=60, json={
        "model": "planner", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 503, r.text
    assert "planner" in r.json()["error"]["message"]
    assert chat(fault_cluster.url, "coder", fresh("Still serving. " + DOC))["choices"][0]["finish_reason"] in ("stop", "length")
    assert not fault_cluster.cluster()["workers"][2]["alive"]
    fault_cluster.workers.restart(2)
    fault_cluster.workers.wait_ready()
    _until(lambda: fault_cluster.cluster()["workers"][2]["alive"], "the restarted decode worker rejoins")
    assert chat(fault_cluster.url, "planner", fresh(DOC))["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(("fault", "check"), [
    ("kill_after_chunks=1", "killed"),
    ("corrupt_chunk=0", "corrupt"),
])
def test_a_failing_prefill_worker_loses_no_request(fault_cluster: Running, colocated: str, fault: str, check: str):
    """The prefill worker dies right after its first chunk, or sends a corrupted one: the
    request completes (the decode worker prefills what is missing) with the colocated output."""
    fault_cluster.workers.kill(0)
    fault_cluster.workers.restart(0, env={"AGENTSHARE_FAULT": fault})
    fault_cluster.workers.wait_ready()
    _until(lambda: fault_cluster.cluster()["workers"][0]["alive"], "the prefill worker rejoins")
    doc = fresh(f"Fault case {check}. " + DOC)  # new from the first block: the whole prefix moves
    before = fault_cluster.stats()
    got = chat(fault_cluster.url, "coder", doc)
    want = chat(colocated, "coder", doc)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    d = httpx.get(f"{fault_cluster.workers.urls[1]}/internal/stats", headers=fault_cluster.internal, timeout=10).json()
    assert d["transfers_failed"] > before[1]["transfers_failed"]
    assert d["imported_blocks"] - before[1]["imported_blocks"] <= 2  # at most the first chunk was kept
    if check == "killed":
        assert fault_cluster.workers.returncode(0) == 17
    else:
        assert d["checksum_failures"] > before[1]["checksum_failures"]
    fault_cluster.workers.kill(0)
    fault_cluster.workers.restart(0, env={})
    fault_cluster.workers.wait_ready()
    _until(lambda: fault_cluster.cluster()["workers"][0]["alive"], "the prefill worker rejoins")


def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting until {what}")


def test_serve_disaggregated_starts_a_working_set_with_one_command_and_stops_it(
    tiny_model_dir: Path, agent_modules: dict[str, Path], tmp_path: Path
):
    """``agentshare serve --disaggregated``: workers are started (each told its threads and the
    secret the launcher made, never on a command line), the router answers, and SIGTERM stops
    every process it started. The router listens where it is told (here every interface, as
    the probe ran it); the workers on 127.0.0.1 only, their HTTP and KV ports alike."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from agentshare.local_server import free_port
    from server.cluster.auth import SECRET_ENV, ClusterSecret

    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    env = {**os.environ, "AGENTSHARE_ADMIN_KEY": ADMIN_KEY, "AGENTSHARE_API_KEYS": " ".join(API_KEYS)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--disaggregated", "--prefill-workers", "1",
         "--decode-workers", "1", "--host", "0.0.0.0", "--port", str(port), "--model", str(tiny_model_dir),
         "--dtype", "float32", "--kv-cache", "16MiB", "--module", f"coder={agent_modules['coder']}",
         "--log-level", "info"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        from tests.server.cluster.conftest import _wait

        _wait(url, proc)
        assert httpx.get(f"{url}/internal/cluster", timeout=10).status_code == 401
        info = httpx.get(f"{url}/internal/cluster", headers=bearer(ADMIN_KEY), timeout=10).json()
        assert [w["role"] for w in info["workers"]] == ["prefill", "decode"]
        assert info["workers"][1]["agents"] == ["base", "coder"]
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 2
        out = chat(url, "coder", fresh("One command. " + DOC), max_tokens=4)
        assert out["usage"]["completion_tokens"] == 4
        listening = {c.pid: sorted({s.laddr.ip for s in c.net_connections("inet") if s.status == psutil.CONN_LISTEN})
                     for c in children}
        assert listening == {c.pid: ["127.0.0.1"] for c in children}, listening  # HTTP and KV ports
        assert {s.laddr.ip for s in psutil.Process(proc.pid).net_connections("inet")
                if s.status == psutil.CONN_LISTEN} == {"0.0.0.0"}
        secret = children[0].environ()[SECRET_ENV]
        assert all(secret not in " ".join(c.cmdline()) for c in [psutil.Process(proc.pid), *children])
        worker_url = info["workers"][1]["url"]
        assert httpx.get(f"{worker_url}/internal/info", timeout=10).status_code == 401
        token = ClusterSecret(secret).headers()
        assert httpx.get(f"{worker_url}/internal/info", headers=token, timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], \
        (tmp_path / "serve.log").read_text()[-3000:]
    text = (tmp_path / "serve.log").read_text()
    assert '"event": "plan"' in text and '"threads": 1' in text
