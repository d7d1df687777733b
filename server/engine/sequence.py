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

from server.engine.constraints import Matcher
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
class Timeline:
    """Where one request's time went and where its prompt's KV came from (on its final event).

    Times are seconds from its arrival in the engine that generated it; a router adds its own
    part (``route``, ``route_s``, ``prefill``, the transfer) with :func:`dataclasses.replace`.
    ``computed + reused + imported`` is the prompt.

    >>> t = Timeline(queue_s=0.5, ttft_s=0.75, e2e_s=1.0, decode_steps=3, computed_tokens=4, reused_tokens=12)
    >>> t.route, t.prefill, t.imported_tokens, t.transfer_bytes
    ('colocated', 'local', 0, 0)
    """

    queue_s: float  # arrival to admission (its KV reserved); to the end if it never was admitted
    ttft_s: float | None  # arrival to its first token (None: it generated none)
    e2e_s: float  # arrival to its end
    decode_steps: int  # tokens after the first (each one a decode step; the first ends the prefill)
    computed_tokens: int  # prompt tokens this engine computed
    reused_tokens: int  # prompt tokens read from this engine's own cache (shared, cached, in flight)
    imported_tokens: int = 0  # prompt tokens whose KV came over a link from a prefill worker
    prefill: str = "local"  # where its shared prefix was prefilled: "local", or the prefill worker's URL
    route: str = "colocated"  # the router's placement reason ("colocated": no router)
    route_s: float = 0.0  # seconds the router took to place it, before this engine saw it
    remote_computed_tokens: int = 0  # of the imported tokens, those the prefill worker computed for it
    transfer_bytes: int = 0  # KV bytes moved for it over the link
    transfer_s: float = 0.0  # seconds those frames took on the link
    transfer_codec: str | None = None  # their payload codec (None: no transfer)


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
    timeline: Timeline | None = None  # on the final event of a request that reached the engine


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
    admitted_at: float | None = None  # when its KV was reserved (the last time, after a re-plan)
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
    exported: bool = False  # a prefill run for a request another worker serves (not a request here)
    imported: list[tuple[int, int]] = field(default_factory=list)  # (block, generation) read first as imported
    first_token_time: float | None = None
    matcher: Matcher | None = None  # its place in its constraint's grammar (None: unconstrained)
    finish_reason: FinishReason | None = None
    split_layer: int | None = None
    """A layer-split module's split (``server/positions.py``): positions before the IP take the
    base's KV below it and the module's own from it on. None: the base's KV of every layer."""
    fill_blocks: list[int] = field(default_factory=list)
    """The family's blocks (held) whose lower layers and hidden state a layer-split request
    reuses for its prefix blocks from ``fill_start`` to ``fill_end``: it recomputes only its top
    layers there (set at admission; released once those positions are written)."""
    fill_start: int = 0
    fill_end: int = 0

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

    def timeline(self, block_size: int, now: float | None = None) -> Timeline:
        """Its timeline, ending ``now`` (default: this instant). Imported tokens are the blocks
        it read first after they arrived over a link, as the engine's counters count them."""
        end = time.monotonic() if now is None else now
        first = None if self.first_token_time is None else self.first_token_time - self.arrival
        queued = (self.admitted_at if self.admitted_at is not None else end) - self.arrival
        imported = len(self.imported) * block_size
        return Timeline(queue_s=queued, ttft_s=first, e2e_s=end - self.arrival,
                        decode_steps=max(0, self.num_generated - 1),
                        computed_tokens=self.prompt_len - self.cached_tokens,
                        reused_tokens=self.cached_tokens - imported, imported_tokens=imported)
