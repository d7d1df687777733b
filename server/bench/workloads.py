"""What an agent session asks: the ``react``, ``reflexion``, ``burst`` and ``trace`` workloads.

A session is a script of chat requests. It draws everything it needs (the lengths, the texts,
the think times) from its own seed when it starts, so the same seed gives the same session in
every arm and every run, whatever order the sessions run in. What it sends next can depend on
what came back: each step appends the earlier answers. Every request asks for a fixed number of
tokens with ``ignore_eos``, so every arm decodes the same amount.

``react``
    One shared context (a window of the standard library's sources, its length drawn from
    ``context``) and the K agents taking ``steps`` steps. In a step the K agents are asked
    together, each its own question after the same messages; then, after a think time drawn
    from ``think``, a simulated tool result (``tool`` tokens of text) and the step's answers
    are appended to the shared messages::

        [system: context] [user: step 1's answers + tool result] ... [user: agent k's question]

``reflexion``
    Actor, evaluator and reflector (the first three agents, dealt round-robin when fewer) in a
    loop of ``steps`` trials over one task context: the actor attempts, the evaluator judges the
    attempt, the reflector says what to change; the reflection joins the context of the next
    trial. One request at a time, a think time between them.

``burst``
    Today's headline shape: one context, the K agents asked together, once.

``trace:FILE``
    A Mooncake-format trace replayed (``../shared/traces/``): each record is a session of one
    request, arriving at its timestamp (scaled to the offered rate). Each 512-token hash id
    becomes ``block_tokens`` tokens of text, the same for the same id, so records that share
    leading hash ids share that prefix; the last hash id is the request's own turn, the others
    its shared context. Output lengths are scaled alike. Record i goes to agent i mod K, so a
    prefix several records share is read by several agents.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from server.bench.client import RequestResult
from server.bench.text import Corpus
from server.kv.trace import TRACE_BLOCK_TOKENS, load_trace
from server.sim.workload import SimRequest, from_trace

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Call:
    """One request of a session: ``agent`` (the served model's name) asked ``messages``."""

    agent: str
    messages: Messages
    max_tokens: int
    step: int


Send = Callable[[Sequence[Call]], Awaitable[list[RequestResult]]]
"""Sends calls together; their results in order."""


class Session(Protocol):
    index: int

    async def run(self, send: Send) -> bool:
        """Play the session; False when a request failed (the session stops there)."""
        ...


class Workload(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def agents(self) -> tuple[str, ...]: ...

    def session(self, index: int, seed: int) -> Session: ...

    def describe(self) -> dict[str, Any]: ...


Range = tuple[float, float]


def parse_range(text: str, what: str) -> Range:
    """``"500-1000"`` or ``"2"`` as (low, high).

    >>> parse_range("500-1000", "context"), parse_range("2", "steps")
    ((500.0, 1000.0), (2.0, 2.0))
    """
    try:
        lo, dash, hi = text.partition("-")
        low, high = float(lo), float(hi if dash else lo)
    except ValueError:
        raise ValueError(f"{what}: expected a number or a range LOW-HIGH, got {text!r}") from None
    if low < 0 or high < low:
        raise ValueError(f"{what}: expected 0 <= LOW <= HIGH, got {text!r}")
    return low, high


def _rng(seed: int, index: int) -> random.Random:
    return random.Random(f"agentshare-bench:{seed}:{index}")


def _draw(rng: random.Random, r: Range) -> float:
    return rng.uniform(*r)


def _tokens(rng: random.Random, r: Range) -> int:
    return max(1, round(rng.uniform(*r)))


QUESTIONS = (
    "Which function above would you change first, and why? One sentence.",
    "List the public names defined above.",
    "Name one bug risk in the code above and where it is.",
    "Summarise what the code above does in one sentence.",
    "Which input would make the code above fail? Say how.",
    "Write the docstring the first function above is missing.",
    "Which names above would you rename, and to what?",
    "What does the last tool result tell us? One sentence.",
)


@dataclass(frozen=True)
class ReAct:
    """K agents over one shared context, ``steps`` steps; see the module's docstring."""

    corpus: Corpus
    agents: tuple[str, ...]
    steps: int = 3
    context: Range = (500, 1000)
    tool: Range = (32, 96)
    think: Range = (0.5, 2.0)
    output_tokens: int = 32
    name: str = "react"

    def describe(self) -> dict[str, Any]:
        return {"workload": self.name, "agents": list(self.agents), "steps": self.steps, "context_tokens": self.context,
                "tool_tokens": self.tool, "think_s": self.think, "output_tokens": self.output_tokens}

    def session(self, index: int, seed: int) -> _ReActSession:
        rng = _rng(seed, index)
        context = f"Session {index}: a file under review.\n\n" + self.corpus.window(rng.randrange(len(self.corpus)),
                                                                                   _tokens(rng, self.context))
        tools = [self.corpus.window(rng.randrange(len(self.corpus)), _tokens(rng, self.tool))
                 for _ in range(self.steps - 1)]
        thinks = [_draw(rng, self.think) for _ in range(self.steps - 1)]
        return _ReActSession(index, self, context, tools, thinks)


@dataclass
class _ReActSession:
    index: int
    w: ReAct
    context: str
    tools: list[str]
    thinks: list[float]

    async def run(self, send: Send) -> bool:
        shared: Messages = [{"role": "system", "content": self.context}]
        for step in range(self.w.steps):
            if step:
                await asyncio.sleep(self.thinks[step - 1])
            calls = [Call(agent, [*shared, {"role": "user", "content": f"Step {step + 1}, {agent}: "
                                            f"{QUESTIONS[(k + step) % len(QUESTIONS)]}"}], self.w.output_tokens, step)
                     for k, agent in enumerate(self.w.agents)]
            results = await send(calls)
            if not all(r.ok for r in results):
                return False
            if step + 1 < self.w.steps:
                answers = "\n".join(f"{r.agent}: {r.text}" for r in results)
                shared.append({"role": "user", "content": f"Step {step + 1} answers:\n{answers}\n\n"
                                                          f"Tool result:\n{self.tools[step]}"})
        return True


def burst(corpus: Corpus, agents: tuple[str, ...], context: Range = (2048, 2048), output_tokens: int = 64) -> ReAct:
    """The headline shape: one context, every agent asked together, once."""
    return ReAct(corpus, agents, steps=1, context=context, output_tokens=output_tokens, name="burst")


@dataclass(frozen=True)
class Reflexion:
    """Actor, evaluator and reflector in a loop of ``steps`` trials; see the module's docstring."""

    corpus: Corpus
    agents: tuple[str, ...]
    steps: int = 2
    context: Range = (500, 1000)
    think: Range = (0.5, 2.0)
    output_tokens: int = 32
    name: str = "reflexion"

    def describe(self) -> dict[str, Any]:
        roles = dict(zip(("actor", "evaluator", "reflector"), self.roles(), strict=True))
        return {"workload": self.name, "agents": list(self.agents), "roles": roles, "trials": self.steps,
                "context_tokens": self.context, "think_s": self.think, "output_tokens": self.output_tokens}

    def roles(self) -> tuple[str, str, str]:
        a = self.agents
        return a[0], a[1 % len(a)], a[2 % len(a)]

    def session(self, index: int, seed: int) -> _ReflexionSession:
        rng = _rng(seed, index)
        context = (f"Task {index}: review the code below and propose a fix for its riskiest part.\n\n"
                   + self.corpus.window(rng.randrange(len(self.corpus)), _tokens(rng, self.context)))
        return _ReflexionSession(index, self, context, [_draw(rng, self.think) for _ in range(3 * self.steps)])


@dataclass
class _ReflexionSession:
    index: int
    w: Reflexion
    context: str
    thinks: list[float]

    async def run(self, send: Send) -> bool:
        actor, evaluator, reflector = self.w.roles()
        out = self.w.output_tokens
        shared: Messages = [{"role": "system", "content": self.context}]
        thinks = iter(self.thinks)
        for trial in range(self.w.steps):
            if trial:
                await asyncio.sleep(next(thinks))
            (attempt,) = await send([Call(actor, [*shared, {"role": "user", "content": f"Trial {trial + 1}: "
                                                           "attempt the task."}], out, 3 * trial)])
            if not attempt.ok:
                return False
            await asyncio.sleep(next(thinks))
            tried = [*shared, {"role": "user", "content": f"Attempt {trial + 1}:\n{attempt.text}"}]
            (verdict,) = await send([Call(evaluator, [*tried, {"role": "user", "content": "Evaluate the attempt: "
                                                              "does it fix the riskiest part? Say why."}],
                                          out, 3 * trial + 1)])
            if not verdict.ok:
                return False
            await asyncio.sleep(next(thinks))
            judged = [*tried, {"role": "user", "content": f"Evaluation:\n{verdict.text}"}]
            (reflection,) = await send([Call(reflector, [*judged, {"role": "user", "content": "Reflect: what "
                                                                  "should the next attempt do differently?"}],
                                             out, 3 * trial + 2)])
            if not reflection.ok:
                return False
            shared.append({"role": "user", "content": f"Reflection after trial {trial + 1}:\n{reflection.text}"})
        return True


@dataclass(frozen=True)
class Trace:
    """A Mooncake-format trace replayed; see the module's docstring. ``limit``: its first records."""

    corpus: Corpus
    agents: tuple[str, ...]
    path: Path
    block_tokens: int = 16
    limit: int | None = None
    name: str = "trace"
    records: list[SimRequest] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if TRACE_BLOCK_TOKENS % self.block_tokens:
            raise ValueError(f"block_tokens must divide {TRACE_BLOCK_TOKENS} (16 or 32), got {self.block_tokens}")
        records = from_trace(load_trace(self.path, limit=self.limit),
                             token_scale=TRACE_BLOCK_TOKENS // self.block_tokens)
        if not records:
            raise ValueError(f"{self.path}: the trace holds no record")
        object.__setattr__(self, "records", records)

    def describe(self) -> dict[str, Any]:
        return {"workload": f"trace:{self.path}", "agents": list(self.agents), "records": len(self.records),
                "block_tokens": self.block_tokens, "trace_span_s": self.span_s}

    @property
    def span_s(self) -> float:
        return self.records[-1].arrival_s - self.records[0].arrival_s

    def arrivals(self, rate: float) -> list[float]:
        """The records' arrival times, scaled so they arrive at ``rate`` per second on average."""
        n = len(self.records)
        t0 = self.records[0].arrival_s
        scale = (n / rate) / self.span_s if self.span_s > 0 else 0.0
        return [(r.arrival_s - t0) * scale if scale else i / rate for i, r in enumerate(self.records)]

    def block(self, hash_id: int) -> str:
        return self.corpus.window(hash_id * 2_654_435_761, self.block_tokens)

    def session(self, index: int, seed: int) -> _TraceSession:
        rec = self.records[index % len(self.records)]
        blocks = [self.block(h) for h in rec.blocks]
        messages: Messages = ([{"role": "system", "content": "\n".join(blocks[:-1])}] if len(blocks) > 1 else [])
        messages.append({"role": "user", "content": blocks[-1]})
        return _TraceSession(index, Call(self.agents[index % len(self.agents)], messages,
                                         max(1, math.ceil(rec.output_tokens)), 0))



@dataclass
class _TraceSession:
    index: int
    call: Call

    async def run(self, send: Send) -> bool:
        (r,) = await send([self.call])
        return r.ok


def make_workload(spec: str, corpus: Corpus, agents: Sequence[str], *, steps: int | None = None,
                  context: Range | None = None, tool: Range = (32, 96), think: Range = (0.5, 2.0),
                  output_tokens: int = 32, block_tokens: int = 16, limit: int | None = None) -> Workload:
    """The workload a ``--workload`` value names: react, reflexion, burst or trace:FILE."""
    agents = tuple(agents)
    if not agents:
        raise ValueError("a workload needs at least one agent (--agents)")
    if steps is not None and steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    if spec == "react":
        return ReAct(corpus, agents, steps or 3, context or (500, 1000), tool, think, output_tokens)
    if spec == "reflexion":
        return Reflexion(corpus, agents, steps or 2, context or (500, 1000), think, output_tokens)
    if spec == "burst":
        return burst(corpus, agents, context or (2048, 2048), output_tokens)
    if spec.startswith("trace:"):
        return Trace(corpus, agents, Path(spec[len("trace:"):]).expanduser(), block_tokens, limit)
    raise ValueError(f"unknown workload {spec!r}: react, reflexion, burst or trace:FILE")
