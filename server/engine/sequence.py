"""One request's state inside the engine, and what the engine reports back for it.

A sequence moves through::

    WAITING ──admit──▶ PREFILL ──last prompt chunk──▶ DECODE ──stop/length──▶ FINISHED
       ▲                 │ (waits while blocks it matched are still being computed elsewhere)
       └── re-plan ──────┘ (a block it waited for was abandoned: start over from a fresh match)

Its KV lives in ``blocks`` (reserved at admission for the prompt plus ``max_tokens``): position
``p`` sits at slot ``blocks[p // B] * B + p % B``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from server.engine.detokenize import TextStream
from server.engine.modules import DecodeModule
from server.engine.sampling import SamplingParams
from server.kv.keys import Layout
from server.kv.pool import PrefixMatch
from server.prompt import Prompt


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class FinishReason(Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context
    PREFILLED = "prefilled"  # a shared context: prefilled and pinned, nothing generated
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens this request did not compute (shared or cached)
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One engine output for one request: a token (with its final text delta) and/or the end."""

    request_id: str
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None


@dataclass(eq=False)
class Sequence:
    request_id: str
    module: DecodeModule
    module_index: int  # row id of the module's LoRA deltas in a step (-1: none)
    prompt: Prompt
    invocation_point: int  # first position computed by the module
    params: SamplingParams
    layout: Layout
    text: TextStream
    generator: torch.Generator | None
    capacity: int  # positions reserved: prompt + max_tokens, capped at the model's context
    pin_ttl: float | None = None  # a shared context: pin its blocks this long, generate nothing
    arrival: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.WAITING
    tokens: list[int] = field(default_factory=list)  # prompt then generated
    blocks: list[int] = field(default_factory=list)
    slot_table: torch.Tensor | None = None  # slot of each reserved position (set at admission)
    prefix_blocks: int = 0  # leading consecutive blocks within the shared context (set at admission)
    match: PrefixMatch | None = None
    num_computed: int = 0  # positions whose KV is written (or shared and ready)
    num_committed_blocks: int = 0  # leading blocks handed to the pool as ready
    pending: tuple[int, ...] = ()  # matched blocks another request is still computing
    cached_tokens: int = 0
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt.token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def usage(self) -> Usage:
        return Usage(self.prompt_len, self.cached_tokens, self.num_generated)
