"""Offered load: sessions arriving at random (open loop) or a fixed number at once (closed loop).

Open loop: sessions arrive as a Poisson process at ``rate`` per second (exponential gaps drawn
from the seed), a ``trace:`` workload at its own timestamps scaled to that rate, whether or not
the server keeps up. Closed loop: ``concurrency`` sessions run at once, each followed by the
next. Either way, new sessions start only within ``duration_s`` and until ``max_sessions`` or
``max_requests`` is reached; the sessions started then run to their end. ``warmup`` sessions run
first, one by one, and are left out of every figure.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from server.bench.client import RequestResult, stream_chat
from server.bench.counters import Sampler
from server.bench.metrics import SessionResult
from server.bench.workloads import Call, Trace, Workload

WARMUP_INDEX = 1_000_000_000
"""Warm-up sessions' indices start here (their texts differ from every measured session's)."""


@dataclass(frozen=True)
class Load:
    """Open loop at ``rate`` sessions per second, or closed loop with ``concurrency`` sessions."""

    rate: float | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give a session rate (open loop) or a concurrency (closed loop), not both")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"the rate must be positive sessions per second, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"the concurrency must be at least 1, got {self.concurrency}")

    @property
    def label(self) -> str:
        return f"rate {self.rate:g}/s" if self.rate is not None else f"concurrency {self.concurrency}"

    def describe(self) -> dict[str, Any]:
        return {"mode": "open", "session_rate": self.rate} if self.rate is not None else \
            {"mode": "closed", "concurrency": self.concurrency}


@dataclass(frozen=True)
class Options:
    duration_s: float = 60.0
    max_sessions: int | None = None
    max_requests: int | None = None
    seed: int = 0
    """Draws the sessions (and the arrivals, unless ``arrival_seed`` is given)."""
    arrival_seed: int | None = None
    """Draws the arrival times alone: a sweep that gives each rate fresh sessions (another seed) keeps
    one arrival process, scaled to each rate."""
    warmup: int = 1
    request_timeout_s: float = 600.0
    api_key: str | None = None
    salt_per_agent: bool = False
    """Send each agent's requests with a ``cache_salt`` of its own: sharing off, as vLLM and SGLang
    key adapters (every agent keeps its own copy of every context)."""
    temperature: float = 0.0
    sample_every_s: float = 1.0
    progress: bool = True


@dataclass
class LoadRun:
    """What one run at one load produced; :func:`server.bench.metrics.summarize` reads it."""

    load: Load
    t0: float
    last_arrival: float
    results: list[RequestResult] = field(default_factory=list)
    sessions: list[SessionResult] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)


class _Driver:
    def __init__(self, client: httpx.AsyncClient, url: str, workload: Workload, opts: Options,
                 bar: tqdm | None) -> None:
        self.client, self.url, self.workload, self.opts, self.bar = client, url, workload, opts, bar
        self.results: list[RequestResult] = []
        self.sessions: list[SessionResult] = []
        self.requests_sent = 0
        self.failed = 0  # measured requests that failed, for the progress bar
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else None

    def body(self, call: Call) -> dict[str, Any]:
        body: dict[str, Any] = {"model": call.agent, "messages": call.messages, "max_tokens": call.max_tokens,
                                "ignore_eos": True, "temperature": self.opts.temperature}
        if self.opts.salt_per_agent:
            body["cache_salt"] = f"agentshare-bench:{call.agent}"
        return body

    async def play(self, index: int, *, warmup: bool = False) -> None:
        async def send(calls: Sequence[Call]) -> list[RequestResult]:
            out = [RequestResult(index, c.agent, c.step, 0.0, c.max_tokens, warmup=warmup) for c in calls]
            self.requests_sent += len(calls)
            await asyncio.gather(*(stream_chat(self.client, self.url, self.body(c), r, headers=self.headers,
                                               timeout=self.opts.request_timeout_s) for c, r in zip(calls, out, strict=True)))
            self.results.extend(out)
            if self.bar is not None and not warmup:
                self.bar.update(len(out))
                if failed := sum(1 for r in out if not r.ok):
                    self.failed += failed
                    self.bar.set_postfix(failed=self.failed)
            return out

        start = time.perf_counter()
        ok = await self.workload.session(index, self.opts.seed).run(send)
        self.sessions.append(SessionResult(index, start, time.perf_counter(), ok, warmup))

    def admitting(self, count: int, elapsed: float) -> bool:
        o = self.opts
        return (elapsed < o.duration_s and (o.max_sessions is None or count < o.max_sessions)
                and (o.max_requests is None or self.requests_sent < o.max_requests))


def arrivals(workload: Workload | None, rate: float, seed: int) -> Iterator[float]:
    """Session start times (seconds from the start): a trace's own, scaled; else Poisson, one
    unit-rate process per seed scaled by ``1 / rate`` (so the same seed at twice the rate brings
    the same sessions in half the time).

    >>> from itertools import islice
    >>> times = list(islice(arrivals(None, 2.0, seed=0), 2000))
    >>> times[0], 1.9 < len(times) / times[-1] < 2.1                  # about 2 per second
    (0.0, True)
    >>> [2 * t for t in islice(arrivals(None, 2.0, seed=0), 3)] == list(islice(arrivals(None, 1.0, seed=0), 3))
    True
    """
    if isinstance(workload, Trace):
        yield from workload.arrivals(rate)
        return
    rng = random.Random(f"agentshare-bench-arrivals:{seed}")  # one unit-rate process, scaled: a sweep's
    t = 0.0                                                    # rates keep their ratios, draw for draw
    while True:
        yield t
        t += rng.expovariate(1.0) / rate


async def run_load(url: str, workload: Workload, load: Load, opts: Options) -> LoadRun:
    """Warm up, then drive ``workload`` at ``load`` against ``url`` (an OpenAI-compatible server's
    root); every request's result, every session's, and the server's counters."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(opts.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        bar = tqdm(desc=f"{workload.name} at {load.label}", unit="req", disable=not opts.progress, leave=False)
        try:
            d = _Driver(client, url, workload, opts, bar)
            for i in range(opts.warmup):
                await d.play(WARMUP_INDEX + i, warmup=True)
            d.requests_sent = 0
            sampler = Sampler(client, url, opts.sample_every_s)
            sampler.start()
            t0 = time.perf_counter()
            last = 0.0
            tasks: list[asyncio.Task[None]] = []
            if load.rate is not None:
                for count, at in enumerate(arrivals(workload, load.rate, opts.seed if opts.arrival_seed is None
                                                                    else opts.arrival_seed)):
                    if not d.admitting(count, at):
                        break
                    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                    last = at
                    tasks.append(asyncio.create_task(d.play(count)))
            else:
                counter = itertools.count()
                starts: list[float] = []

                async def lane() -> None:
                    while True:
                        now = time.perf_counter() - t0
                        index = next(counter)
                        if not d.admitting(index, now):
                            return
                        starts.append(now)
                        await d.play(index)

                tasks = [asyncio.create_task(lane()) for _ in range(load.concurrency or 1)]
                await asyncio.gather(*tasks)
                last = max(starts, default=0.0)
            await asyncio.gather(*tasks)
            await sampler.stop()
        finally:
            bar.close()
    return LoadRun(load, t0, last, d.results, d.sessions, sampler.report())
