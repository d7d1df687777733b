"""Traces across processes with OpenTelemetry: optional (the ``otel`` extra), off by default.

One trace per request: the router's (or the colocated server's) HTTP span, its ``generate``
span per choice, the route and the KV transfer, and the workers' spans, which continue the
trace from the W3C ``traceparent`` header of the router's internal calls (and from the KV
transfer's ``meta`` on the receiving side). Every function here is a no-op while tracing is
off or OpenTelemetry is not installed, so callers never check.

Enabling, per process (:func:`configure`, called by each entry point): ``--otel`` or
``AGENTSHARE_OTEL=1`` (spans go to OTLP when ``opentelemetry-exporter-otlp`` is installed, to
``OTEL_EXPORTER_OTLP_ENDPOINT``), and/or ``AGENTSHARE_TRACE_FILE=path`` (each process appends its
finished spans to ``path`` as JSON lines). Tests install a provider of their own (:func:`install`).

>>> with span("work", items=3) as s:   # tracing off: a span that records nothing
...     s.set_attribute("done", True)
>>> headers(), traceparent(), current_ids()
({}, None, None)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

log = logging.getLogger("agentshare.api")

ENV = "AGENTSHARE_OTEL"
FILE_ENV = "AGENTSHARE_TRACE_FILE"
T = TypeVar("T")
_state: dict[str, Any] = {"tracer": None, "service": None}
_open: dict[str, Any] = {}  # spans begun by one call and ended by another (a KV transfer's receiving end)


class _NoSpan:
    """What a span is while tracing is off."""

    def set_attribute(self, key: str, value: Any) -> None: ...

    def set_attributes(self, attributes: Mapping[str, Any]) -> None: ...

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None: ...

    def update_name(self, name: str) -> None: ...

    def record_exception(self, exception: BaseException) -> None: ...

    def end(self, end_time: int | None = None) -> None: ...


NO_SPAN = _NoSpan()


def requested(flag: bool = False) -> bool:
    """Tracing asked for: by ``flag`` (``--otel``), ``AGENTSHARE_OTEL=1`` or a trace file.

    >>> requested(), requested(True)
    (False, True)
    """
    return flag or os.environ.get(ENV, "").lower() in ("1", "true", "yes") or bool(os.environ.get(FILE_ENV))


def configure(service: str, *, flag: bool = False) -> bool:
    """Start tracing in this process as ``service`` (e.g. ``agentshare-router``) if it is asked
    for; True if spans are now recorded. Without OpenTelemetry installed, a warning says what to
    install and nothing is recorded."""
    if not requested(flag):
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        log.warning("tracing asked for but OpenTelemetry is not installed: pip install 'agentshare[otel]'",
                    extra={"event": "tracing_unavailable"})
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    sinks = []
    if path := os.environ.get(FILE_ENV):
        exporter: Any = JsonLinesExporter(path, service)  # duck-typed: this module imports without the SDK
        provider.add_span_processor(SimpleSpanProcessor(exporter))  # each span as it ends: readable at once
        sinks.append(path)
    if os.environ.get(ENV) or flag:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            if not sinks:
                log.warning("tracing off: no exporter: install opentelemetry-exporter-otlp "
                            "(pip install 'agentshare[otlp]') or set AGENTSHARE_TRACE_FILE",
                            extra={"event": "tracing_unavailable"})
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            sinks.append("otlp")
    if not sinks:
        return False
    # not made the global provider: FastAPI (0.16x) traces every request itself with the global
    # one, which would double each server span and trace the health polls
    install(provider, service)
    log.info("tracing", extra={"event": "tracing", "service": service, "sinks": ",".join(sinks)})
    return True


def install(provider: Any, service: str = "agentshare") -> None:
    """Record spans with ``provider`` (an SDK ``TracerProvider``; None: stop tracing)."""
    _state["tracer"] = None if provider is None else provider.get_tracer("agentshare")
    _state["service"] = service


def enabled() -> bool:
    return _state["tracer"] is not None


@contextlib.contextmanager
def span(name: str, *, parent: Any = None, **attributes: Any) -> Iterator[Any]:
    """A span, current within the block (a child of the current one, or of ``parent``: a span
    or a ``traceparent`` string). Not for use across an async generator's ``yield``."""
    tracer = _state["tracer"]
    if tracer is None:
        yield NO_SPAN
        return
    with tracer.start_as_current_span(name, context=_context(parent), attributes=_clean(attributes)) as s:
        yield s


def start(name: str, *, parent: Any = None, start_time: int | None = None, **attributes: Any) -> Any:
    """A span begun now (or at ``start_time``, ns since the epoch), not made current: end it
    with ``.end()``. Its parent: ``parent`` (a span or a ``traceparent``), else the current span."""
    tracer = _state["tracer"]
    if tracer is None:
        return NO_SPAN
    return tracer.start_span(name, context=_context(parent), attributes=_clean(attributes), start_time=start_time)


@contextlib.contextmanager
def active(s: Any) -> Iterator[None]:
    """Make ``s`` (from :func:`start`) the current span within the block, without ending it."""
    if s is NO_SPAN or _state["tracer"] is None:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(s, end_on_exit=False):
        yield


async def traced(name: str, work: Awaitable[T], **attributes: Any) -> T:
    """Await ``work`` inside a span named ``name`` (a task's body: ``create_task(traced(...))``)."""
    with span(name, **attributes):
        return await work


def current() -> Any:
    """The current span (:data:`NO_SPAN` when off)."""
    if _state["tracer"] is None:
        return NO_SPAN
    from opentelemetry import trace

    return trace.get_current_span()


def annotate(**attributes: Any) -> None:
    """Set attributes on the current span."""
    current().set_attributes(_clean(attributes))


def headers(carrier: dict[str, str] | None = None) -> dict[str, str]:
    """``carrier`` (a new dict) with the current trace context (``traceparent``) added."""
    carrier = {} if carrier is None else carrier
    if _state["tracer"] is not None:
        from opentelemetry import propagate

        propagate.inject(carrier)
    return carrier


def traceparent() -> str | None:
    """The current span's W3C ``traceparent``, or None."""
    return headers().get("traceparent")


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the current span, or None (off, or no span)."""
    if _state["tracer"] is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return trace.format_trace_id(ctx.trace_id), trace.format_span_id(ctx.span_id)


def begin(key: str, name: str, *, parent: Any = None, **attributes: Any) -> None:
    """Start a span that another call ends (:func:`finish` with the same ``key``); a ``parent``
    given as headers without a ``traceparent`` starts none (the caller traces nothing)."""
    if isinstance(parent, Mapping) and "traceparent" not in parent:
        return
    if _state["tracer"] is not None:
        _open[key] = start(name, parent=parent, **attributes)


def finish(key: str, *, error: str | None = None, **attributes: Any) -> None:
    """End the span :func:`begin` started under ``key`` (if any), marked failed with ``error``."""
    s = _open.pop(key, None)
    if s is None:
        return
    s.set_attributes(_clean(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        s.set_status(Status(StatusCode.ERROR, error))
    s.end()


def engine_spans(parent: Any, timeline: Any, arrival_ns: int) -> None:
    """Child spans ``queue``, ``prefill`` and ``decode`` of ``parent``, from a request's
    :class:`~server.engine.sequence.Timeline` (seconds since its arrival at ``arrival_ns``)."""
    if parent is NO_SPAN or _state["tracer"] is None or timeline is None:
        return

    def at(seconds: float) -> int:
        return arrival_ns + int(seconds * 1e9)

    first = timeline.ttft_s if timeline.ttft_s is not None else timeline.e2e_s
    phases = [("queue", 0.0, timeline.queue_s, {}),
              ("prefill", timeline.queue_s, first, {"computed_tokens": timeline.computed_tokens,
                                                    "reused_tokens": timeline.reused_tokens,
                                                    "imported_tokens": timeline.imported_tokens}),
              ("decode", first, timeline.e2e_s, {"decode_steps": timeline.decode_steps})]
    for name, begin_s, end_s, attributes in phases:
        start(name, parent=parent, start_time=at(begin_s), **attributes).end(end_time=at(max(begin_s, end_s)))


def _context(parent: Any) -> Any:
    if parent is None:
        return None
    from opentelemetry import propagate, trace

    if isinstance(parent, str):
        return propagate.extract({"traceparent": parent})
    if isinstance(parent, Mapping):
        return propagate.extract(parent)
    if parent is NO_SPAN:
        return None
    return trace.set_span_in_context(parent)


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry's attribute types only (None dropped, anything else as text)."""
    return {k: v if isinstance(v, str | bool | int | float) else str(v) for k, v in attributes.items() if v is not None}


class JsonLinesExporter:
    """A span exporter appending one JSON object per finished span to ``path`` (several
    processes may share the file: each line is one write)::

        {"trace_id", "span_id", "parent_id", "name", "service", "kind", "start_ns", "end_ns",
         "status", "attributes", "events"}
    """

    def __init__(self, path: str, service: str) -> None:
        self.path, self.service = path, service
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.trace import format_span_id, format_trace_id

        lines = []
        for s in spans:
            ctx = s.get_span_context()
            lines.append(json.dumps({
                "trace_id": format_trace_id(ctx.trace_id), "span_id": format_span_id(ctx.span_id),
                "parent_id": format_span_id(s.parent.span_id) if s.parent is not None else None,
                "name": s.name, "service": s.resource.attributes.get("service.name", self.service),
                "kind": s.kind.name.lower(), "start_ns": s.start_time, "end_ns": s.end_time,
                "status": s.status.status_code.name.lower(), "attributes": dict(s.attributes or {}),
                "events": [{"name": e.name, "ts_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                           for e in s.events],
            }, default=str) + "\n")
        data = "".join(lines).encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None: ...

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


UNTRACED = frozenset({"/health", "/metrics", "/internal/stats", "/internal/info"})
"""Paths polled all the time (health loops, scrapes): traced only when the caller sends a trace."""


class TraceMiddleware:
    """One server span per HTTP request (the whole response, streamed ones to their last byte),
    continuing the caller's trace from its ``traceparent`` header; named by method and route."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        tracer = _state["tracer"]
        if scope["type"] != "http" or tracer is None:
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if scope["path"] in UNTRACED and "traceparent" not in carrier:
            await self.app(scope, receive, send)
            return
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind

        status = [500]

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        method = scope.get("method", "GET")
        with tracer.start_as_current_span(f"{method} {scope['path']}", context=propagate.extract(carrier),
                                          kind=SpanKind.SERVER,
                                          attributes={"http.request.method": method, "url.path": scope["path"]}) as s:
            try:
                await self.app(scope, receive, send_status)
            finally:
                if template := getattr(scope.get("route"), "path", None):
                    s.update_name(f"{method} {template}")
                    s.set_attribute("http.route", template)
                s.set_attribute("http.response.status_code", status[0])
                if rid := scope.get("state", {}).get("log", {}).get("request_id"):
                    s.set_attribute("agentshare.request_id", str(rid))
