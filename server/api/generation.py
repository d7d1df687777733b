"""Run one HTTP request's choices on the engine and stream their events back, merged.

::

    request ──admit (pool pressure check)──▶ n × engine.generate ──▶ one queue of ChoiceEvents
                                                  │                         │
             a bad request raises here, before ───┘    consumer leaves ─────┴─▶ every choice
             any byte of the response is sent                                   cancelled, KV freed

Each choice's first event (or error) is awaited before anything is yielded, so a request that
the engine refuses becomes an HTTP error, never a broken stream, and the first chunk carries
a token. Latencies (TTFT, ITL, E2E) are observed here, per choice.

>>> p = sampling_params(limit=None, temperature=None, top_p=None, top_k=-1, seed=None, stop=(),
...                     default_max_tokens=16)
>>> p.max_tokens, p.temperature, p.top_k
(16, 1.0, 0)
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from starlette.requests import Request

from server.api.errors import ApiError, overloaded
from server.api.metrics import Metrics
from server.engine.async_engine import AsyncEngine
from server.engine.core import EngineCore
from server.engine.errors import Overloaded
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, TokenEvent
from server.prompt import Prompt

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    index: int
    event: TokenEvent


def sampling_params(
    *, limit: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
    seed: int | None, stop: Sequence[str], default_max_tokens: int, ignore_eos: bool = False,
    logprobs: int | None = None,
) -> SamplingParams:
    """Engine sampling parameters with the OpenAI defaults (temperature 1, top_p 1)."""
    return SamplingParams(
        max_tokens=limit if limit is not None else default_max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None or top_k < 0 else top_k,
        seed=seed, stop=tuple(stop), ignore_eos=ignore_eos, logprobs=logprobs,
    )


def pool_pressure(core: EngineCore, module: str, prompt: Prompt, capacity: int, salt: str) -> float | None:
    """Seconds until pins expire if this request could only be admitted once they do (the pool
    is full of pinned contexts), else None. Runs on the engine thread."""
    bs = core.config.block_size
    now = core.pool.clock()
    live = [p for p in core.pool.pins if p.deadline > now]
    if not live:
        return None
    pinned = {b for p in live for b in p.block_ids}
    match = core.explain(module, prompt, salt=salt)
    usable = set(match.block_ids)
    need = math.ceil(min(capacity, core.max_context) / bs) - len(usable)
    if need <= core.pool.capacity - len(pinned - usable):
        return None
    return min(p.deadline for p in live) - now


async def admit(engine: AsyncEngine, metrics: Metrics, module: str, prompt: Prompt, capacity: int,
                salt: str) -> None:
    """Refuse (429) a request that pinned contexts leave no room for."""
    wait = await engine.run(lambda core: pool_pressure(core, module, prompt, capacity, salt)
                            if module in core.modules else None)
    if wait is not None:
        metrics.rejected.labels("kv_pool_pinned").inc()
        raise overloaded("pinned contexts fill the KV pool; release a context or retry after its TTL", wait)


async def stream_choices(
    engine: AsyncEngine, metrics: Metrics, request_id: str, module: str,
    prompts: Sequence[Prompt], params: SamplingParams, *, n: int = 1, salt: str = "",
) -> AsyncIterator[ChoiceEvent]:
    """Events of ``n`` choices per prompt (choice index = prompt index * n + i), merged.

    A seeded request gives choice ``i`` the seed ``seed + i`` so choices differ yet repeat.
    Leaving the iteration early cancels every choice and frees its KV.
    """
    for prompt in prompts:
        await admit(engine, metrics, module, prompt, len(prompt.token_ids) + params.max_tokens, salt)
    queue: asyncio.Queue[tuple[int, TokenEvent | None, BaseException | None]] = asyncio.Queue()
    start = time.monotonic()

    async def pump(index: int, prompt: Prompt, p: SamplingParams) -> None:
        try:
            async for ev in engine.generate(f"{request_id}/{index}", module, prompt, p, salt=salt):
                await queue.put((index, ev, None))
        except Exception as exc:  # noqa: BLE001 - typed engine errors arrive before the first event; re-raised by the consumer
            await queue.put((index, None, exc))

    choices = [(i * n + j, prompt, replace(params, seed=params.seed + j) if params.seed is not None else params)
               for i, prompt in enumerate(prompts) for j in range(n)]
    tasks = [asyncio.create_task(pump(*c)) for c in choices]
    timing = _Timing(metrics, module, start)
    try:
        started: set[int] = set()
        early: list[ChoiceEvent] = []
        while len(started) < len(tasks):  # hold output until every choice is accepted
            index, ev, exc = await queue.get()
            if exc is not None:
                if isinstance(exc, Overloaded):
                    metrics.rejected.labels("queue_full").inc()
                raise exc
            started.add(index)
            assert ev is not None
            early.append(ChoiceEvent(index, ev))
        finished = 0
        for item in early:
            timing.observe(item)
            finished += item.event.finish_reason is not None
            yield item
        while finished < len(tasks):
            index, ev, exc = await queue.get()
            if exc is not None:
                raise exc
            assert ev is not None
            timing.observe(ChoiceEvent(index, ev))
            finished += ev.finish_reason is not None
            yield ChoiceEvent(index, ev)
    finally:
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
