"""A trace through the real disaggregated set: one request, offloaded (a long prefix never
seen), is one trace with spans from the router, the prefill worker and the decode worker, read
from the JSON-lines file every process appends its spans to (``AGENTSHARE_TRACE_FILE``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.cluster.conftest import (
    API_KEYS,
    Running,
    bearer,
    fresh,
    specs_1p2d,
    start_cluster,
)

pytest.importorskip("opentelemetry.sdk")
pytestmark = pytest.mark.timeout(600)

DOC = "Traced notes: " + " ".join(f"item {i} is {i * 5 % 11}." for i in range(60))
SECRET = "a-prompt-phrase-no-span-or-log-may-carry-91c2"


@pytest.fixture(scope="module")
def traced(agent_modules, worker_config, tmp_path_factory) -> Iterator[tuple[Running, Path]]:
    """A cluster of its own (one prefill, two decode workers), every process tracing to one file."""
    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    mp = pytest.MonkeyPatch()
    mp.setenv("AGENTSHARE_TRACE_FILE", str(trace_file))  # inherited by the workers and the router
    try:
        with start_cluster(specs_1p2d(agent_modules), worker_config, tmp_path_factory.mktemp("traced-logs"),
                           router_args=("--offload-threshold", "64", "--transfer-codec", "fp32",
                                        "--no-bandwidth-aware")) as running:
            try:
                yield running, trace_file
            except BaseException:
                print(running.logs())
                raise
    finally:
        mp.undo()


def spans_of(path: Path, trace_id: str | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    spans = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [s for s in spans if trace_id is None or s["trace_id"] == trace_id]


def test_one_offloaded_request_is_one_trace_across_three_processes(traced: tuple[Running, Path]):
    running, path = traced
    r = httpx.post(f"{running.url}/v1/chat/completions", headers=bearer(API_KEYS[0]), timeout=120, json={
        "model": "coder", "temperature": 0, "max_tokens": 4, "ignore_eos": True,
        "messages": [{"role": "user", "content": fresh(DOC)}, {"role": "user", "content": f"Go on. {SECRET}"}]})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    # the router's HTTP span ends once the response is sent; the workers' spans end about then
    deadline = time.monotonic() + 20
    while True:
        roots = [s for s in spans_of(path) if s["name"] == "POST /v1/chat/completions"
                 and s["attributes"].get("agentshare.request_id") == rid]
        spans = spans_of(path, roots[0]["trace_id"]) if roots else []
        names = {(s["service"], s["name"]) for s in spans}
        ids = {s["span_id"] for s in spans}
        # a parent span ends, and is written, after its children: wait for the whole tree too
        whole = all(s["parent_id"] in ids for s in spans if s["parent_id"] is not None)
        if ({("agentshare-decode", "kv.receive"), ("agentshare-decode", "decode"),
                ("agentshare-prefill", "POST /internal/prefill")} <= names and whole) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(roots) == 1, spans_of(path)
    assert {s["service"] for s in spans} == {"agentshare-router", "agentshare-prefill", "agentshare-decode"}
    by_id = {s["span_id"]: s for s in spans}
    assert [s["name"] for s in spans if s["parent_id"] is None] == ["POST /v1/chat/completions"]
    assert all(s["parent_id"] in by_id for s in spans if s["parent_id"] is not None)  # one tree

    def one(service: str, name: str) -> dict[str, Any]:
        (s,) = [s for s in spans if (s["service"], s["name"]) == (service, name)]
        return s

    def parent(s: dict[str, Any]) -> tuple[str, str]:
        p = by_id[s["parent_id"]]
        return p["service"], p["name"]

    gen, route = one("agentshare-router", "generate"), one("agentshare-router", "route")
    assert parent(gen) == ("agentshare-router", "POST /v1/chat/completions")
    assert parent(route) == ("agentshare-router", "generate") and route["attributes"]["reason"] == "offloaded"
    transfer = one("agentshare-router", "transfer")
    assert parent(transfer) == ("agentshare-router", "route")
    job = one("agentshare-prefill", "POST /internal/prefill")
    assert parent(job) == ("agentshare-router", "transfer") and job["attributes"]["blocks"] >= 16
    receive = one("agentshare-decode", "kv.receive")
    assert parent(receive) == ("agentshare-prefill", "POST /internal/prefill")
    assert receive["status"] != "error" and receive["attributes"]["written_blocks"] == job["attributes"]["blocks"]
    worker_gen = one("agentshare-decode", "POST /internal/generate")
    assert parent(worker_gen) == ("agentshare-router", "generate")
    assert worker_gen["attributes"]["agentshare.request_id"] == f"{rid}/0"
    for phase in ("queue", "prefill", "decode"):
        assert parent(one("agentshare-decode", phase)) == ("agentshare-decode", "POST /internal/generate")
    assert gen["attributes"]["route"] == "offloaded" and gen["attributes"]["imported_tokens"] >= 256
    assert SECRET not in path.read_text()
    assert SECRET not in running.logs()
