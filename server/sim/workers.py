"""Simulated workers and links: service-time models only, driven by :mod:`server.sim.simulator`.

Prefill worker: one prefill at a time, first come first served, ``tokens / prefill_tok_s``
each. Because it never preempts, a job's start and end are known when it is enqueued.

Link (a prefill worker's egress): first come first served at ``bandwidth``; a transfer of ``n``
bytes may start when its prefill starts (layer-wise pipelining over ``layers`` layers) and ends
no earlier than one layer's worth after the prefill ends::

    start  = max(prefill start, link free)
    sent   = max(start + n / bw, prefill end + n / (layers * bw))      arrival = sent + latency

With ``layers = 1`` this is store-and-forward: ``max(prefill end, link free) + n / bw``.

Decode worker (continuous batching, vLLM-style chunked prefill)::

    iteration = [one chunk of the first local prefill whose dependencies are ready]
              + [one decode step of every running request]
    time      = chunk / prefill_tok_s + decode_step(batch)

Requests join the batch at iteration boundaries. With no prefill pending the worker runs
``k`` identical decode steps as one event (``k`` = fewest tokens any running request has
left); a request that arrives meanwhile cuts that run short at the next step boundary.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from server.sim.cache import PrefixCache
from server.sim.profile import ServiceProfile


@dataclass(slots=True)
class Link:
    bandwidth_bytes_s: float
    latency_s: float = 0.0
    layers: int = 1
    free_at: float = 0.0
    _sends: deque[tuple[float, float, int]] = field(default_factory=deque)  # (begin, end, bytes)

    def queued_bytes(self, now: float) -> float:
        """Booked bytes not yet on the wire: the backlog a policy should weigh.

        Each booked transfer is counted as sending its bytes during the last ``n / bw`` seconds
        before its end, so time a pipelined transfer spends waiting for its prefill is not
        mistaken for queued bytes.
        """
        sends = self._sends
        while sends and sends[0][1] <= now:
            sends.popleft()
        bw = self.bandwidth_bytes_s
        return sum(n if now <= begin else (end - now) * bw for begin, end, n in sends)

    def reserve(self, prefill_start: float, prefill_end: float, nbytes: int) -> float:
        """Book a transfer; returns when its last byte arrives."""
        bw = self.bandwidth_bytes_s
        start = max(prefill_start, self.free_at)
        sent = max(start + nbytes / bw, prefill_end + nbytes / (self.layers * bw))
        self.free_at = sent
        if nbytes:
            self._sends.append((sent - nbytes / bw, sent, nbytes))
        return sent + self.latency_s


@dataclass(slots=True)
class PrefillWorker:
    id: int
    profile: ServiceProfile
    cache: PrefixCache
    free_at: float = 0.0
    _ends: deque[float] = field(default_factory=deque)

    def enqueue(self, now: float, tokens: int) -> tuple[float, float]:
        """Book a prefill of ``tokens``; returns (start, end)."""
        start = max(now, self.free_at)
        end = start + self.profile.prefill_seconds(tokens)
        self.free_at = end
        self._ends.append(end)
        return start, end

    def queue_depth(self, now: float) -> int:
        while self._ends and self._ends[0] <= now:
            self._ends.popleft()
        return len(self._ends)

    def queued_tokens(self, now: float) -> int:
        return math.ceil(max(0.0, self.free_at - now) * self.profile.prefill_tok_s)


@dataclass(slots=True)
class LocalPrefill:
    request: int
    remaining: int
    deps: frozenset[int]
    output_tokens: int


@dataclass(slots=True)
class Iteration:
    start: float
    end: float
    step_s: float
    steps: int
    prefill: LocalPrefill | None = None
    chunk: int = 0


@dataclass(slots=True)
class IterationResult:
    prefilled: list[LocalPrefill]
    finished: list[int]


class DecodeWorker:
    """A decode worker's queues and batch; the simulator schedules its iteration ends."""

    def __init__(self, id: int, profile: ServiceProfile, cache: PrefixCache) -> None:
        self.id = id
        self.profile = profile
        self.cache = cache
        self.prefill_q: list[LocalPrefill] = []
        self.joiners: dict[int, int] = {}  # request -> decode tokens left, joins next iteration
        self.parked: list[tuple[int, frozenset[int], int]] = []  # KV here, waiting on deps
        self.running: dict[int, int] = {}
        self.done: set[int] = set()  # requests whose blocks on this worker are committed
        self.incoming = 0  # offloaded requests whose KV is still on its way here
        self.busy: Iteration | None = None
        self.version = 0  # bumped whenever the pending iteration-end event changes

    # ---- what the policies see ---------------------------------------------------------------

    def queued_tokens(self) -> int:
        return sum(p.remaining for p in self.prefill_q)

    def queue_depth(self) -> int:
        """Requests placed here that are not decoding yet."""
        return len(self.prefill_q) + len(self.joiners) + len(self.parked) + self.incoming

    def effective_prefill_tok_s(self) -> float:
        """Local prefill rate with the current batch's decode step riding on every chunk."""
        chunk = self.profile.prefill_chunk_tokens
        step = self.profile.decode_step_seconds(len(self.running))
        return chunk / (self.profile.prefill_seconds(chunk) + step)

    def batch(self) -> int:
        """The decode batch once everything placed here has joined."""
        return len(self.running) + self.queue_depth()

    # ---- work arriving -------------------------------------------------------------------------

    def enqueue_prefill(self, p: LocalPrefill) -> None:
        self.prefill_q.append(p)

    def kv_ready(self, request: int, deps: frozenset[int], decode_tokens: int) -> bool:
        """The request's KV has arrived. Returns True if it is complete (first token now)."""
        if deps <= self.done:
            self.start_decode(request, decode_tokens)
            return True
        self.parked.append((request, deps, decode_tokens))
        return False

    def committed(self, request: int) -> list[int]:
        """``request``'s blocks here are complete; returns parked requests this completes."""
        self.done.add(request)
        ready = [(r, n) for r, d, n in self.parked if d <= self.done]
        if ready:
            self.parked = [p for p in self.parked if not p[1] <= self.done]
            for r, n in ready:
                self.start_decode(r, n)
        return [r for r, _ in ready]

    def start_decode(self, request: int, decode_tokens: int) -> None:
        """Join the batch at the next iteration (nothing to do if no token is left)."""
        if decode_tokens > 0:
            self.joiners[request] = decode_tokens

    # ---- iterations ----------------------------------------------------------------------------

    def poke(self, now: float) -> float | None:
        """Start an iteration if idle, or cut a decode run short for new work.

        Returns the end time to schedule (the caller schedules it with ``self.version``), or None
        when the pending event stands.
        """
        it = self.busy
        if it is None:
            return self._start(now)
        if it.prefill is not None or it.steps == 1 or not (self.joiners or self._eligible()):
            return None
        done = max(1, math.ceil((now - it.start) / it.step_s - 1e-9))
        if done >= it.steps:
            return None
        it.steps, it.end = done, it.start + done * it.step_s
        self.version += 1
        return it.end

    def _eligible(self) -> LocalPrefill | None:
        for p in self.prefill_q:
            if p.deps <= self.done:
                return p
        return None

    def _start(self, now: float) -> float | None:
        self.running.update(self.joiners)
        self.joiners.clear()
        b = len(self.running)
        step = self.profile.decode_step_seconds(b)
        head = self._eligible()
        if head is not None:
            chunk = min(self.profile.prefill_chunk_tokens, head.remaining)
            dur = self.profile.prefill_seconds(chunk) + step
            self.busy = Iteration(now, now + dur, step, 1 if b else 0, head, chunk)
        elif b:
            k = min(self.running.values())
            self.busy = Iteration(now, now + k * step, step, k)
        else:
            return None
        self.version += 1
        return self.busy.end

    def finish_iteration(self) -> IterationResult:
        """Apply the iteration that just ended; the caller then pokes to start the next."""
        it = self.busy
        assert it is not None, "no iteration in progress"
        self.busy = None
        finished: list[int] = []
        if it.steps:
            for r in list(self.running):
                left = self.running[r] - it.steps
                if left <= 0:
                    del self.running[r]
                    finished.append(r)
                else:
                    self.running[r] = left
        prefilled: list[LocalPrefill] = []
        if it.prefill is not None:
            it.prefill.remaining -= it.chunk
            if it.prefill.remaining <= 0:
                self.prefill_q.remove(it.prefill)
                prefilled.append(it.prefill)
        return IterationResult(prefilled, finished)
