"""Run one HTTP request's choices on the engine and stream their events back, merged.

::

    request ──▶ n × backend.submit ──▶ n event streams ──▶ one queue of ChoiceEvents
                     │                                         │
   a refused request raises here (bad input,       consumer leaves ─▶ every choice
   429), before any byte of the response is sent                    cancelled, KV freed

Every choice is accepted by the engine before anything is yielded, so a request that the
engine refuses becomes an HTTP error, never a broken stream. Latencies (TTFT, ITL, E2E) are
observed here, per choice; queue and KV transfer times from its final event's timeline. The sampling parameters come from the request itself
(``SamplingParams.from_spec(body.sampling(), ...)``: the defaults and clamps live there).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from starlette.requests import Request

from server import tracing
from server.api.errors import ApiError, from_engine
from server.api.metrics import Metrics
from server.backend import Backend, EventSource
from server.engine.errors import Overloaded, PromptTooLong
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, TokenEvent
from server.prompt import Prompt

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    index: int
    event: TokenEvent


async def stream_choices(
    backend: Backend, metrics: Metrics, request_id: str, module: str,
    prompts: Sequence[Prompt], params: SamplingParams, *, n: int = 1, salt: str = "",
    prompt_param: str = "messages",
) -> AsyncIterator[ChoiceEvent]:
    """Events of ``n`` choices per prompt (choice index = prompt index * n + i), merged.

    Every choice is submitted before anything is yielded, so a refused request (bad input,
    429) raises before any byte of the response; a prompt too long for the model names
    ``prompt_param``. A seeded request gives choice ``i`` the seed ``seed + i`` so choices
    differ yet repeat. Leaving the iteration early cancels every choice and frees its KV.
    """
    choices = [(i * n + j, prompt, replace(params, seed=params.seed + j) if params.seed is not None else params)
               for i, prompt in enumerate(prompts) for j in range(n)]
    start = time.monotonic()
    streams: list[tuple[int, EventSource]] = []
    spans: dict[int, tuple[Any, int]] = {}  # each choice's "generate" span, and when it was submitted
    try:
        for index, prompt, p in choices:
            rid = f"{request_id}/{index}"
            spans[index] = (tracing.start("generate", request_id=rid, agent=module,
                                          prompt_tokens=len(prompt.token_ids)), time.time_ns())
            with tracing.active(spans[index][0]):  # the router's calls to its workers carry this trace
                streams.append((index, await backend.submit(rid, module, prompt, p, salt=salt)))
    except BaseException as exc:
        if isinstance(exc, Overloaded):
            metrics.rejected.labels(exc.reason).inc()
        for _, stream in streams:
            stream.cancel()
        for s, _ in spans.values():
            s.set_attribute("error", type(exc).__name__)
            s.end()
        if isinstance(exc, PromptTooLong):
            raise from_engine(exc, prompt_param=prompt_param) from exc
        raise
    queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()

    async def pump(index: int, stream: EventSource) -> None:
        async for ev in stream:
            await queue.put(ChoiceEvent(index, ev))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in streams]
    timing = _Timing(metrics, module, start)
    try:
        finished = 0
        while finished < len(tasks):
            item = await queue.get()
            timing.observe(item)
            finished += item.event.finish_reason is not None
            if item.event.finish_reason is not None and item.index in spans:
                _end_span(*spans.pop(item.index), item.event)
            yield item
    finally:
        for s, _ in spans.values():  # left early (client gone)
            s.set_attribute("cancelled", True)
            s.end()
        # Synchronous first: inside a cancelled scope (client gone) every await is interrupted.
        for _, stream in streams:
            stream.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _end_span(span: Any, submitted_ns: int, ev: TokenEvent) -> None:
    """End a choice's span with its figures (never its text); where its engine ran in this
    process (no router), its queue, prefill and decode as child spans."""
    span.set_attribute("finish_reason", str(ev.finish_reason))
    if ev.usage is not None:
        span.set_attributes({"prompt_tokens": ev.usage.prompt_tokens, "cached_tokens": ev.usage.cached_tokens,
                             "completion_tokens": ev.usage.completion_tokens})
    t = ev.timeline
    if t is not None:
        span.set_attributes({"route": t.route, "prefill": t.prefill, "queue_s": t.queue_s, "e2e_s": t.e2e_s,
                             "imported_tokens": t.imported_tokens, "transfer_bytes": t.transfer_bytes})
        if t.route == "colocated":
            tracing.engine_spans(span, t, submitted_ns)
    span.end()


class _Timing:
    def __init__(self, metrics: Metrics, agent: str, start: float) -> None:
        self._m, self._agent, self._start = metrics, agent, start
        self._last: dict[int, float] = {}

    def observe(self, item: ChoiceEvent) -> None:
        now = time.monotonic()
        ev = item.event
        if ev.token_id is not None:
            last = self._last.get(item.index)
            if last is None:
                self._m.ttft.labels(self._agent).observe(now - self._start)
            else:
                self._m.itl.labels(self._agent).observe(now - last)
            self._last[item.index] = now
        if ev.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self._m.e2e.labels(self._agent).observe(now - self._start)
            t = ev.timeline
            if t is not None:
                self._m.queue.labels(self._agent).observe(t.queue_s)
                if t.transfer_bytes:
                    self._m.transfer.labels(t.transfer_codec or "").observe(t.transfer_s)


def check_finish(ev: TokenEvent) -> None:
    """Turn an abnormal end (engine error, shutdown) into an HTTP error."""
    if ev.finish_reason is FinishReason.ERROR:
        raise ApiError(500, f"generation failed: {ev.error}", type="server_error", code="engine_error")
    if ev.finish_reason is FinishReason.CANCELLED:
        raise ApiError(503, "the request was cancelled (server shutting down)", type="service_unavailable",
                       code="cancelled")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first (frees its KV)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    finally:
        watcher.cancel()


async def collect(events: AsyncIterator[ChoiceEvent], on_event: Callable[[ChoiceEvent], object]) -> None:
    """Drain ``events`` into ``on_event`` (for non-streamed responses), each checked first (:func:`check_finish`)."""
    async for item in events:
        check_finish(item.event)
        on_event(item)
