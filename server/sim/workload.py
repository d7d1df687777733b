"""Simulated requests: the Mooncake trace, and synthetic multi-agent sessions.

A :class:`SimRequest` carries block ids instead of tokens (one id per ``block_tokens`` tokens,
as the trace's hash ids are one per 512 tokens): two requests whose ``blocks`` start alike
share that prefix. ``ip_blocks`` is how many leading blocks the base model computes (the shared
context, before the invocation point); the rest belong to the request's decode module.

Multi-agent sessions (PrefillShare's workload shape, open loop)::

    session s starts at s * session_interval_s; round r at start + r * round_interval_s
    round r: N agents (modules agent0..agentN-1) arrive together, each with prompt
        [ context: context_tokens + r * growth_tokens ][ own turn: turn_tokens ]
    the context is the same blocks for every agent of the session and extends round by round
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from server.kv.trace import TRACE_BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request to simulate. ``family=None`` marks a foreign module (private prefill)."""

    id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    module: str = "base"
    family: str | None = "fam"
    ip_blocks: int | None = None
    """Blocks before the invocation point; None: every block is the family's (base module)."""
    session: int = -1

    def __post_init__(self) -> None:
        if self.input_tokens < 1 or self.output_tokens < 1 or not self.blocks:
            raise ValueError(f"request {self.id}: needs >= 1 input and output token and a block")


def from_trace(
    trace: Iterable[TraceRequest],
    *,
    token_scale: int = 1,
    time_scale: float = 1.0,
    family: str = "fam",
) -> list[SimRequest]:
    """Trace requests as simulated ones; run them with ``block_tokens = 512 // token_scale``.

    ``token_scale`` divides input and output lengths (a scaled-down trace for small models:
    hash ids keep their sharing, each standing for ``512 // token_scale`` tokens);
    ``time_scale`` stretches arrival times (2.0 halves the arrival rate).

    >>> reqs = from_trace([TraceRequest(1500, 1024, 100, (0, 1))], token_scale=16)
    >>> reqs[0].arrival_s, reqs[0].input_tokens, reqs[0].output_tokens
    (1.5, 64, 7)
    """
    if TRACE_BLOCK_TOKENS % token_scale:
        raise ValueError("token_scale must divide 512")
    return [
        SimRequest(
            i,
            t.timestamp_ms / 1000.0 * time_scale,
            max(1, math.ceil(t.input_length / token_scale)),
            max(1, math.ceil(t.output_length / token_scale)),
            t.hash_ids,
            family=family,
        )
        for i, t in enumerate(trace)
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class MultiAgentWorkload:
    """N agents per shared context. Token counts must be multiples of ``block_tokens``.

    >>> w = MultiAgentWorkload(sessions=2, agents=3, rounds=2, context_tokens=64, turn_tokens=32,
    ...                        growth_tokens=32, output_tokens=8, block_tokens=32)
    >>> reqs = w.requests(); len(reqs), reqs[0].blocks, reqs[1].blocks, reqs[6].blocks
    (12, (0, 1, 2), (0, 1, 3), (0, 1, 5, 6))
    """

    sessions: int
    agents: int
    rounds: int = 1
    context_tokens: int = 2048
    turn_tokens: int = 64
    growth_tokens: int = 0
    output_tokens: int = 32
    session_interval_s: float = 1.0
    round_interval_s: float = 10.0
    block_tokens: int = 32
    family: str = "fam"

    def __post_init__(self) -> None:
        for name in ("context_tokens", "turn_tokens", "growth_tokens"):
            if getattr(self, name) % self.block_tokens:
                raise ValueError(f"{name} must be a multiple of block_tokens")
        if min(self.sessions, self.agents, self.rounds) < 1 or self.turn_tokens < self.block_tokens:
            raise ValueError("need >= 1 session, agent and round, and a turn of >= 1 block")

    def requests(self) -> list[SimRequest]:
        ids = itertools.count()
        bt = self.block_tokens
        out: list[SimRequest] = []
        for s in range(self.sessions):
            context = [next(ids) for _ in range(self.context_tokens // bt)]
            start = s * self.session_interval_s
            for r in range(self.rounds):
                if r:
                    context += [next(ids) for _ in range(self.growth_tokens // bt)]
                for a in range(self.agents):
                    turn = [next(ids) for _ in range(self.turn_tokens // bt)]
                    out.append(
                        SimRequest(
                            0,
                            start + r * self.round_interval_s,
                            (len(context) + len(turn)) * bt,
                            self.output_tokens,
                            (*context, *turn),
                            module=f"agent{a}",
                            family=self.family,
                            ip_blocks=len(context),
                            session=s,
                        )
                    )
        out.sort(key=lambda q: q.arrival_s)  # stable: agents of one round stay in order
        return [
            SimRequest(i, q.arrival_s, q.input_tokens, q.output_tokens, q.blocks, q.module,
                       q.family, q.ip_blocks, q.session)
            for i, q in enumerate(out)
        ]
