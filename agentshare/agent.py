"""An agent: a name, the decode module it runs on, its instruction, its default sampling.

Requests are laid out in the canonical order of docs/design.md §2: the shared context first (computed
once by the base model), then the agent's own turn — its instruction and the prompt of this
call, as one user message — computed by its decode module::

    [ shared context ........ ] [ user: instruction + prompt | <assistant> answer ... ]

>>> planner = Agent("planner", instruction="Plan the work in three numbered steps.",
...                 sampling=Sampling(max_tokens=64, temperature=0))
>>> planner.module, planner.turn("Focus on the database.")
('base', 'Plan the work in three numbered steps.\\n\\nFocus on the database.')
>>> planner.sampling.merged(max_tokens=16, stop="\\n\\n").wire()
{'max_tokens': 16, 'temperature': 0, 'stop': ['\\n\\n']}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

BASE = "base"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """Sampling parameters; ``None`` leaves the server's default (256 tokens, temperature 1, no
    penalty). Each is a field of the native generate request (``GenerateRequest``) of the same name.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    repetition_penalty: float | None = None  # > 0; 1: off; above 1 discourages prompt and output tokens
    frequency_penalty: float | None = None  # [-2, 2]; 0: off; per occurrence in the output
    presence_penalty: float | None = None  # [-2, 2]; 0: off; once per token in the output

    def merged(self, **overrides: Any) -> Sampling:
        """These parameters with ``overrides`` (those not ``None``) on top."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        given: dict[str, Any] = {k: (tuple([v] if isinstance(v, str) else v) if k == "stop" and v is not None else v)
                 for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, **given)

    def wire(self) -> dict[str, Any]:
        """The request fields that are set."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        stop = out["stop"]
        if stop is not None:
            out["stop"] = [stop] if isinstance(stop, str) else list(stop)
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True, slots=True)
class Agent:
    """One member of a team.

    Args:
        name: how results are labelled (``"planner"``).
        module: the server's agent (decode module) it runs on; ``"base"`` is the base model
            itself. ``client.agents()`` lists what the server serves.
        instruction: the agent's standing instruction, placed *after* the shared context.
        sampling: its default sampling parameters (a call's keywords override them).
    """

    name: str
    module: str = BASE
    instruction: str = ""
    sampling: Sampling = field(default_factory=Sampling)

    def turn(self, prompt: str | None = None) -> str:
        """The text of this agent's turn: its instruction, then this call's prompt."""
        parts = [p for p in (self.instruction.strip(), (prompt or "").strip()) if p]
        if not parts:
            raise ValueError(f"agent {self.name!r}: give it an instruction or a prompt")
        return "\n\n".join(parts)


def as_agent(agent: Agent | str) -> Agent:
    """An :class:`Agent`; a plain string names the server's agent (module) directly."""
    return agent if isinstance(agent, Agent) else Agent(agent, module=agent)
