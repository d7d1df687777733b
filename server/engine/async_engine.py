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

    watchdog thread: an iteration (commands + step + hooks) running past
    ``EngineConfig.step_timeout`` ends every request the engine holds with an error, refuses new
    work (``Unavailable``) and reports the engine degraded (:meth:`AsyncEngine.health`) until the
    step returns; the thread then cancels those requests in the core (their KV freed) and serves
    again. A step that raises ends its requests with an error; the thread keeps serving.

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
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Any, TypeVar

from server.engine.core import EngineCore
from server.engine.errors import EngineError, Unavailable
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, TokenEvent
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


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """The engine thread's state, read without waiting for it: queue figures as of its last
    iteration, and why it is degraded (None: it is not). ``stalls``: iterations the watchdog
    stopped since start."""

    waiting: int
    running: int
    degraded: str | None = None
    stalls: int = 0


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

    def __init__(
        self, core: EngineCore | Callable[[], EngineCore], *, idle_wait: float = 0.05, step_timeout: float | None = None
    ) -> None:
        """``core``: the engine, or a function that builds it, called on the engine thread (what
        a server does: see :meth:`load`). ``step_timeout``: the watchdog's limit (default: the
        core's ``config.step_timeout``)."""
        self._inbox: queue.SimpleQueue[_Add | _Cancel | _Call | None] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[TokenEvent], None]] = {}
        self._idle_wait = idle_wait
        self._hooks: list[Callable[[EngineCore], None]] = []  # engine thread only
        self._closed = False
        if step_timeout is not None and not step_timeout > 0:
            raise ValueError(f"step_timeout must be positive, got {step_timeout}")
        # Shared with the watchdog, under _lock: the sinks, when the current iteration began,
        # why the engine is degraded, and the requests the watchdog ended (to cancel in the core).
        self._lock = threading.Lock()
        self._busy_since: float | None = None
        self._degraded: str | None = None
        self._abandoned: set[str] = set()
        self._counts = (0, 0)  # waiting, running after the last iteration
        self.stalls = 0
        self._stop = threading.Event()
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        if isinstance(core, EngineCore):
            self.core = core
            built.set_result(None)
        self._thread = threading.Thread(target=self._run_thread, args=(core, built), name="agentshare-engine",
                                        daemon=True)
        self._thread.start()
        built.result()  # a build that failed raises here, in the caller's thread
        self.step_timeout = step_timeout if step_timeout is not None else self.core.config.step_timeout
        self._watchdog = threading.Thread(target=self._watch, name="agentshare-watchdog", daemon=True)
        self._watchdog.start()

    @classmethod
    def load(cls, build: Callable[[], EngineCore], **kwargs: Any) -> AsyncEngine:
        """Build the core on the engine thread, then serve it there: every torch op of the engine
        (loading, casting, packing, steps) then runs on one native thread with one OpenMP team.

        Why: with libgomp, each thread that runs parallel regions keeps a team of its own. A core
        loaded on the main thread and stepped on the engine thread leaves the main thread's idle
        team behind, the process then has more OpenMP threads than cores, libgomp stops spinning
        between regions, and every op of a step waits for its threads to wake. Measured here
        (default model, bf16, 2 threads, one request decoding over 2,048 cached tokens): 35.7 ms a
        step when loaded and stepped on one thread, 51.4 ms when loaded on another.
        """
        return cls(build, **kwargs)

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
                loop.call_soon_threadsafe(finish, event)

        def finish(event: TokenEvent) -> None:
            if not final.done():
                final.set_result(event)

        def add(core: EngineCore) -> None:
            core.add_context(context_id, token_ids, ttl=ttl, salt=salt)
            with self._lock:
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
        def remove(core: EngineCore) -> None:
            if hook in self._hooks:
                self._hooks.remove(hook)

        await self.run(remove)

    def close(self) -> None:
        """Stop the thread; requests still running end with a cancellation."""
        if not self._closed:
            self._closed = True
            self._stop.set()
            self._inbox.put(None)
            self._thread.join(timeout=30)

    def health(self) -> EngineHealth:
        """Degraded while an iteration runs past the watchdog's limit, or once the thread died;
        never waits for the engine thread."""
        with self._lock:
            reason, since = self._degraded, self._busy_since
        if reason is None and not self._thread.is_alive() and not self._closed:
            reason = "the engine thread has stopped"
        if reason is not None and since is not None and self._thread.is_alive():
            reason = f"{reason}; it has now run for {time.monotonic() - since:.0f} s"
        return EngineHealth(*self._counts, degraded=reason, stalls=self.stalls)

    def _send(self, cmd: _Add | _Cancel | _Call, *, quiet: bool = False) -> None:
        if self._closed:
            if quiet:
                return
            raise EngineClosed("the engine is shut down")
        with self._lock:  # checked and queued at once: the watchdog drains under the same lock
            if self._degraded is not None and not isinstance(cmd, _Cancel):
                raise Unavailable(f"the engine cannot take work now ({self._degraded}); retry later")
            self._inbox.put(cmd)

    # ---- engine thread ---------------------------------------------------------------------

    def _run_thread(self, core: EngineCore | Callable[[], EngineCore], built: concurrent.futures.Future[None]) -> None:
        if not built.done():  # build the core here (AsyncEngine.load says why), then serve it
            assert callable(core)
            try:
                self.core = core()
            except BaseException as exc:  # the caller raises it; this thread has nothing to serve
                built.set_exception(exc)
                return
            built.set_result(None)
        try:
            self._loop()
        except BaseException as exc:  # a bug in the loop itself: say so, fail what it held
            log.critical("the engine thread died", exc_info=exc, extra={"event": "engine_died"})
            self._stop_all(f"the engine thread died ({type(exc).__name__}: {exc})")

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
            with self._lock:
                self._busy_since = time.monotonic()
            for cmd in cmds:
                if cmd is None:
                    self._shutdown()
                    return
                try:
                    self._handle(cmd)
                except Exception:  # a bug handling one command must not stop the engine
                    log.exception("an engine command failed", extra={"event": "command_failed"})
            steps = self.core.stats.steps
            events = self._step()
            for event in events:
                self._deliver(event)
            for hook in list(self._hooks):
                try:
                    hook(self.core)
                except Exception:  # a hook's bug must not stop the engine
                    log.exception("step hook failed; removing it")
                    self._hooks.remove(hook)
            self._settle()
            idle = not events and self.core.stats.steps == steps

    def _step(self) -> list[TokenEvent]:
        """One step; if the step itself raises (not one request: the core isolates those), end
        every request it holds with the error and keep serving."""
        try:
            self.core.expire()  # pins end on time even while nothing runs
            return self.core.step() if self.core.has_work else []
        except Exception as exc:
            log.exception("an engine step failed; its requests end with an error", extra={"event": "step_failed"})
            return self.core.fail_all(f"the engine step failed ({type(exc).__name__}: {exc})")

    def _settle(self) -> None:
        """The iteration is over: cancel in the core what the watchdog ended meanwhile (their KV
        freed), publish the queue figures, and leave the degraded state."""
        with self._lock:
            abandoned, self._abandoned = self._abandoned, set()
            stalled, self._degraded, self._busy_since = self._degraded, None, None
        for request_id in abandoned:
            self.core.cancel(request_id)
        self._counts = (len(self.core.waiting), len(self.core.running))
        if stalled is not None:
            log.warning("the engine recovered from a stuck step", extra={"event": "engine_recovered",
                                                                          "error": stalled})

    # ---- watchdog thread -------------------------------------------------------------------

    def _watch(self) -> None:
        every = min(1.0, self.step_timeout / 4)
        while not self._stop.wait(every):
            with self._lock:
                since, stalled = self._busy_since, self._degraded is not None
            if since is not None and not stalled and time.monotonic() - since > self.step_timeout:
                self.stalls += 1
                log.error("an engine step is stuck; its requests end with an error",
                          extra={"event": "engine_stuck", "limit_s": self.step_timeout})
                self._stop_all(f"an engine step ran past the {self.step_timeout:g} s limit (step_timeout)",
                               only_if_busy_since=since)

    def _stop_all(self, reason: str, *, only_if_busy_since: float | None = None) -> None:
        """Mark the engine degraded; end every request it holds, and every queued command, with
        ``reason`` (from the watchdog, or from a dying engine thread)."""
        with self._lock:
            if only_if_busy_since is not None and self._busy_since != only_if_busy_since:
                return  # that iteration ended meanwhile
            self._degraded = reason
            sinks, self._sinks = self._sinks, {}
            self._abandoned.update(sinks)
            queued: list[Any] = []
            while True:
                try:
                    queued.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        error = f"{reason}; the request was stopped: retry it"
        for request_id, sink in sinks.items():
            sink(TokenEvent(request_id, None, "", finish_reason=FinishReason.ERROR, error=error))
        for cmd in queued:
            if cmd is None:
                self._inbox.put(None)  # a shutdown: leave it for the engine thread
            elif isinstance(cmd, (_Add, _Call)):
                _resolve(cmd.done, exc=Unavailable(f"the engine cannot take work now ({reason}); retry later"))

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
                _resolve(cmd.done, exc=exc)
                return
            with self._lock:
                self._sinks[cmd.request_id] = cmd.sink
            if not _resolve(cmd.done):  # the caller stopped waiting (client gone): nobody reads it
                self._handle(_Cancel(cmd.request_id))
        elif isinstance(cmd, _Cancel):
            event = self.core.cancel(cmd.request_id)
            if event is not None:
                self._deliver(event)
        else:
            try:
                result = cmd.fn(self.core)
            except Exception as exc:
                _resolve(cmd.done, exc=exc)
            else:
                _resolve(cmd.done, result)

    def _deliver(self, event: TokenEvent) -> None:
        with self._lock:
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


def _resolve(future: concurrent.futures.Future[Any], result: Any = None, *, exc: BaseException | None = None) -> bool:
    """Complete a caller's future unless it was cancelled meanwhile (its awaiting task was, e.g.
    the client left); False then. Setting a cancelled future raises, and would stop the thread."""
    if not future.set_running_or_notify_cancel():
        return False
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
    return True
