"""The engine on its own thread, for asyncio callers (the HTTP server).

torch releases the GIL while it computes, so one engine thread steps the core while the event
loop keeps serving HTTP. The core is owned by that thread alone: callers talk to it through a
command queue, and get their tokens back through one asyncio queue per request::

    event loop                          engine thread
    ──────────                          ─────────────
    generate() ── Add ───────────────▶  core.add_request()  (typed errors come back raised)
         ◀──────── TokenEvent ───────── core.step() ... per token
    (consumer leaves) ── Cancel ─────▶  core.cancel(): KV freed
    run(fn) ───────── Call ──────────▶  fn(core)  (stats, pins: anything touching the core)

>>> from server.engine.build import load_engine
>>> from server.prompt import text_prompt
>>> engine = AsyncEngine(load_engine(model_dir, dtype="float32"))
>>> prompt = text_prompt(engine.core.tokenizer, "One replica per zone.", " Replicas per zone:")
>>> async for event in engine.generate("r1", "base", prompt, SamplingParams(max_tokens=8, ignore_eos=True)):
...     if event.finish_reason:
...         print(event.finish_reason, event.usage)
FinishReason.LENGTH Usage(prompt_tokens=11, cached_tokens=0, completion_tokens=8)
>>> engine.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Any, TypeVar

from server.engine.core import EngineCore
from server.engine.errors import EngineError
from server.engine.sampling import SamplingParams
from server.engine.sequence import TokenEvent
from server.prompt import Prompt

T = TypeVar("T")
log = logging.getLogger("agentshare.engine")


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    module: str
    prompt: Prompt
    params: SamplingParams
    salt: str
    prefix_codec: str | None
    sink: Callable[[TokenEvent], None]
    done: concurrent.futures.Future[None]


@dataclass(frozen=True, slots=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Call:
    fn: Callable[[EngineCore], Any]
    done: concurrent.futures.Future[Any]


class EngineClosed(EngineError):
    """The engine was shut down."""


class EventStream:
    """The events of one submitted request; ``aclose()`` before the end cancels it."""

    def __init__(self, engine: AsyncEngine, request_id: str, events: asyncio.Queue[TokenEvent]) -> None:
        self.request_id, self._engine, self._events, self.finished = request_id, engine, events, False

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        event = await self._events.get()
        self.finished = event.finish_reason is not None
        return event

    def cancel(self) -> None:
        """Cancel the request unless it already finished (synchronous: safe in cleanup code
        that runs inside a cancelled scope, where any await would be interrupted)."""
        if not self.finished:
            self.finished = True
            self._engine._send(_Cancel(self.request_id), quiet=True)

    async def aclose(self) -> None:
        self.cancel()


class AsyncEngine:
    """Drive an :class:`EngineCore` from a background thread; stream tokens to asyncio."""

    def __init__(self, core: EngineCore, *, idle_wait: float = 0.05) -> None:
        self.core = core
        self._inbox: queue.SimpleQueue[_Add | _Cancel | _Call | None] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[TokenEvent], None]] = {}
        self._idle_wait = idle_wait
        self._hooks: list[Callable[[EngineCore], None]] = []  # engine thread only
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="agentshare-engine", daemon=True)
        self._thread.start()

    # ---- caller side (event loop) ----------------------------------------------------------

    async def submit(
        self, request_id: str, module: str, prompt: Prompt, params: SamplingParams, *, salt: str = "",
        prefix_codec: str | None = None,
    ) -> EventStream:
        """Queue a request; raises the core's typed error for a bad one. Iterate the returned
        stream for its events; closing it early cancels the request and frees its KV.
        ``prefix_codec``: see :meth:`EngineCore.add_request`."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._send(_Add(request_id, module, prompt, params, salt, prefix_codec, sink, done))
        await asyncio.wrap_future(done)
        return EventStream(self, request_id, events)

    async def generate(
        self, request_id: str, module: str, prompt: Prompt, params: SamplingParams, *, salt: str = ""
    ) -> AsyncIterator[TokenEvent]:
        """:meth:`submit` and stream in one: errors arrive at the first iteration."""
        stream = await self.submit(request_id, module, prompt, params, salt=salt)
        try:
            async for event in stream:
                yield event
        finally:
            stream.cancel()

    async def add_context(
        self, context_id: str, token_ids: SequenceOf[int], *, ttl: float, salt: str = ""
    ) -> TokenEvent:
        """Prefill and pin a shared context; returns its final (PREFILLED) event."""
        loop = asyncio.get_running_loop()
        final: asyncio.Future[TokenEvent] = loop.create_future()

        def sink(event: TokenEvent) -> None:
            if event.finish_reason is not None:
                loop.call_soon_threadsafe(lambda: final.done() or final.set_result(event))

        def add(core: EngineCore) -> None:
            core.add_context(context_id, token_ids, ttl=ttl, salt=salt)
            self._sinks[context_id] = sink

        await self.run(add)
        try:
            return await final
        finally:
            if not final.done():
                self._send(_Cancel(context_id), quiet=True)

    async def run(self, fn: Callable[[EngineCore], T]) -> T:
        """Run ``fn(core)`` on the engine thread and return its result."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._send(_Call(fn, done))
        return await asyncio.wrap_future(done)

    async def add_step_hook(self, hook: Callable[[EngineCore], None]) -> None:
        """Call ``hook(core)`` on the engine thread after every step and every batch of commands
        (e.g. to ship KV blocks as they are committed), until :meth:`remove_step_hook`."""
        await self.run(lambda core: self._hooks.append(hook))

    async def remove_step_hook(self, hook: Callable[[EngineCore], None]) -> None:
        await self.run(lambda core: hook in self._hooks and self._hooks.remove(hook))

    def close(self) -> None:
        """Stop the thread; requests still running end with a cancellation."""
        if not self._closed:
            self._closed = True
            self._inbox.put(None)
            self._thread.join(timeout=30)

    def _send(self, cmd: _Add | _Cancel | _Call, *, quiet: bool = False) -> None:
        if self._closed:
            if quiet:
                return
            raise EngineClosed("the engine is shut down")
        self._inbox.put(cmd)

    # ---- engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        idle = True
        while True:
            # Block for a command only when there is nothing to step (or the last step could
            # not progress: e.g. waiting requests need KV that pins still hold); otherwise take
            # what has arrived and step again.
            cmds: list[Any] = []
            if idle:
                try:
                    cmds.append(self._inbox.get(timeout=self._wait_budget()))
                except queue.Empty:
                    pass
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if cmd is None:
                    self._shutdown()
                    return
                self._handle(cmd)
            steps = self.core.stats.steps
            self.core.expire()  # pins end on time even while nothing runs
            events = self.core.step() if self.core.has_work else []
            for event in events:
                self._deliver(event)
            for hook in list(self._hooks):
                try:
                    hook(self.core)
                except Exception:  # a hook's bug must not stop the engine
                    log.exception("step hook failed; removing it")
                    self._hooks.remove(hook)
            idle = not events and self.core.stats.steps == steps

    def _wait_budget(self) -> float | None:
        """How long the idle thread may block: until the next pin deadline, or forever."""
        if self.core.has_work:
            return self._idle_wait
        deadline = self.core.pool.next_pin_deadline()
        return None if deadline is None else max(0.0, deadline - self.core.pool.clock()) + 1e-3

    def _handle(self, cmd: _Add | _Cancel | _Call) -> None:
        if isinstance(cmd, _Add):
            try:
                self.core.add_request(cmd.request_id, cmd.module, cmd.prompt, cmd.params, salt=cmd.salt,
                                      prefix_codec=cmd.prefix_codec)
            except Exception as exc:
                cmd.done.set_exception(exc)
                return
            self._sinks[cmd.request_id] = cmd.sink
            cmd.done.set_result(None)
        elif isinstance(cmd, _Cancel):
            event = self.core.cancel(cmd.request_id)
            if event is not None:
                self._deliver(event)
        else:
            try:
                cmd.done.set_result(cmd.fn(self.core))
            except Exception as exc:
                cmd.done.set_exception(exc)

    def _deliver(self, event: TokenEvent) -> None:
        sink = self._sinks.get(event.request_id)
        if event.finish_reason is not None:
            self._sinks.pop(event.request_id, None)
        if sink is not None:
            sink(event)

    def _shutdown(self) -> None:
        for seq in list(self.core.waiting) + list(self.core.running):
            event = self.core.cancel(seq.request_id)
            if event is not None:
                self._deliver(event)
