"""Run one HTTP request's choices on the engine and stream their events back, merged.

::

    request ──▶ n × backend.submit ──▶ n event streams ──▶ one queue of ChoiceEvents
                     │                                         │
   a refused request raises here (bad input,       consumer leaves ─▶ every choice
   429), before any byte of the response is sent                    cancelled, KV freed

Every choice is accepted by the engine before anything is yielded, so a request that the
engine refuses becomes an HTTP error, never a broken stream. Latencies (TTFT, ITL, E2E) are
observed here, per choice.

>>> p = sampling_params(limit=None, temperature=None, top_p=None, top_k=-1, seed=None, stop=(),
...                     default_max_tokens=16)
>>> p.max_tokens, p.temperature, p.top_k
(16, 1.0, 0)

Values the schema accepts but float32 sampling cannot represent are clamped to their meaning: a
temperature below 1e-5 is greedy (as vLLM does), a top_p below 1e-6 keeps only the most likely
token (which it does anyway for any vocabulary under a million tokens):

>>> q = sampling_params(limit=4, temperature=1e-300, top_p=1e-300, top_k=None, seed=None, stop=(),
...                     default_max_tokens=16)
>>> q.temperature, q.top_p
(0.0, 1e-06)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from starlette.requests import Request

from server.api.errors import ApiError, from_engine
from server.api.metrics import Metrics
from server.backend import Backend, EventSource
from server.engine.errors import Overloaded, PromptTooLong
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, TokenEvent
from server.prompt import Prompt

T = TypeVar("T")

GREEDY_BELOW = 1e-5  # a temperature under this samples greedily
MIN_TOP_P = 1e-6  # float32 rounds smaller values to 0, which would keep no token at all


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    index: int
    event: TokenEvent


def sampling_params(
    *, limit: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
    seed: int | None, stop: Sequence[str], default_max_tokens: int, ignore_eos: bool = False,
    logprobs: int | None = None,
) -> SamplingParams:
    """Engine sampling parameters with the OpenAI defaults (temperature 1, top_p 1), clamped
    to what float32 sampling represents (the request schemas have checked the ranges)."""
    temperature = 1.0 if temperature is None else temperature
    return SamplingParams(
        max_tokens=limit if limit is not None else default_max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=1.0 if top_p is None else max(top_p, MIN_TOP_P),
        top_k=0 if top_k is None or top_k < 0 else top_k,
        seed=seed, stop=tuple(stop), ignore_eos=ignore_eos, logprobs=logprobs,
    )


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
    try:
        for index, prompt, p in choices:
            streams.append((index, await backend.submit(f"{request_id}/{index}", module, prompt, p, salt=salt)))
    except BaseException as exc:
        if isinstance(exc, Overloaded):
            metrics.rejected.labels(exc.reason).inc()
        for _, stream in streams:
            stream.cancel()
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
            yield item
    finally:
        # Synchronous first: inside a cancelled scope (client gone) every await is interrupted.
        for _, stream in streams:
            stream.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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


async def collect(events: AsyncIterator[ChoiceEvent], on_event: Callable[[ChoiceEvent], None]) -> None:
    """Drain ``events`` into ``on_event`` (for non-streamed responses)."""
    async for item in events:
        on_event(item)
