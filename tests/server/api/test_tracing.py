"""Traces and logs of the colocated server (in this process, spans kept by the SDK's in-memory
exporter): one trace per request, continued from a caller's ``traceparent``; log records carry
the request id and the trace id, never the prompt text."""

from __future__ import annotations

import io
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from server import tracing
from server.api.logs import JsonFormatter

HTTP = "POST /v1/chat/completions"
SECRET = "the-prompt-text-must-never-leave-the-request-7f3a"


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider, "agentshare")
    yield exporter
    tracing.install(None)


@pytest.fixture(scope="module")
def url(spans: InMemorySpanExporter, start_server: Callable[..., str]) -> str:
    return start_server()


@pytest.fixture
def logs() -> Iterator[io.StringIO]:
    """The agentshare loggers' records, formatted as the server formats them (when emitted)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("agentshare")
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield out
    logger.removeHandler(handler)
    logger.setLevel(before)


def chat(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "coder", "temperature": 0, "max_tokens": 3, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Summarise: {SECRET}"}]})
    assert r.status_code == 200, r.text
    return r


def finished(exporter: InMemorySpanExporter, until: str | None = None) -> list:
    """The spans finished since the last call (waiting, with ``until``, for the span of that
    name: the HTTP span ends after the response's last byte, once the server logged it)."""
    deadline = time.monotonic() + 10
    while until is not None and not any(s.name == until for s in exporter.get_finished_spans()):
        assert time.monotonic() < deadline, f"no {until!r} span"
        time.sleep(0.01)
    got = list(exporter.get_finished_spans())
    exporter.clear()
    return got


def test_one_request_is_one_trace_with_its_route_and_engine_phases(url: str, spans: InMemorySpanExporter):
    finished(spans)
    rid = chat(url).json()["id"]
    got = finished(spans, HTTP)
    assert len({s.context.trace_id for s in got}) == 1
    by_name = {s.name: s for s in got}
    assert set(by_name) == {"POST /v1/chat/completions", "generate", "queue", "prefill", "decode"}
    http, gen = by_name["POST /v1/chat/completions"], by_name["generate"]
    assert http.parent is None and http.attributes["agentshare.request_id"] == rid
    assert http.attributes["http.response.status_code"] == 200
    assert gen.parent.span_id == http.context.span_id
    assert gen.attributes["request_id"] == f"{rid}/0" and gen.attributes["agent"] == "coder"
    assert gen.attributes["completion_tokens"] == 3 and gen.attributes["route"] == "colocated"
    for phase in ("queue", "prefill", "decode"):
        assert by_name[phase].parent.span_id == gen.context.span_id
        assert gen.start_time <= by_name[phase].start_time <= by_name[phase].end_time <= gen.end_time
    assert by_name["decode"].attributes["decode_steps"] == 2
    assert not any(SECRET in json.dumps(dict(s.attributes or {})) for s in got)


def test_a_request_carrying_a_traceparent_continues_that_trace(url: str, spans: InMemorySpanExporter):
    finished(spans)
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    chat(url, {"traceparent": f"00-{trace_id}-{parent_id}-01"})
    got = finished(spans, HTTP)
    assert {f"{s.context.trace_id:032x}" for s in got} == {trace_id}
    (http,) = [s for s in got if s.name == "POST /v1/chat/completions"]
    assert f"{http.parent.span_id:016x}" == parent_id and http.parent.is_remote


def test_health_polls_make_no_traces(url: str, spans: InMemorySpanExporter):
    finished(spans)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert finished(spans) == []


def test_log_lines_carry_the_request_and_trace_ids_and_never_the_prompt(
    url: str, spans: InMemorySpanExporter, logs: io.StringIO
):
    finished(spans)
    rid = chat(url).json()["id"]
    trace_id = f"{finished(spans, HTTP)[0].context.trace_id:032x}"
    lines = [json.loads(line) for line in logs.getvalue().splitlines()]
    (record,) = [r for r in lines if r.get("event") == "request" and r.get("request_id") == rid]
    assert record["trace_id"] == trace_id and len(record["span_id"]) == 16
    assert record["endpoint"] == "/v1/chat/completions" and record["status"] == 200
    assert SECRET not in logs.getvalue()


def test_without_opentelemetry_tracing_stays_off(monkeypatch: pytest.MonkeyPatch):
    """The server runs without the otel extra: asking for tracing warns and records nothing."""
    for name in [m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.setenv(tracing.ENV, "1")
    saved = dict(tracing._state)
    try:
        assert tracing.configure("agentshare") is False
        assert tracing._state == saved
    finally:
        tracing._state.update(saved)
