"""The workers' internal HTTP API: request and response bodies (pydantic, the wire edge only).

::

    router ──▶ decode worker   POST /internal/lookup     Lookup        -> Cached
                               POST /internal/explain    Explain       -> Report
                               POST /internal/kv/expect  Expect        -> Expected
                               POST /internal/kv/abort   TransferRef   -> 204
                               POST /internal/generate   Generate      -> NDJSON of Event lines
    router ──▶ prefill worker  POST /internal/prefill    Prefill       -> Prefilled (after the ack)
                               POST /internal/lookup     Lookup        -> Cached
                               POST /internal/contexts   Context       -> Cached; DELETE .../{id}
    router ──▶ any worker      GET  /internal/info       WorkerInfo
                               GET  /internal/stats      WorkerStats
    worker ──▶ router          POST /internal/workers    Join          (a worker on another host)

Engine objects cross as plain fields and are rebuilt on the other side (no pickle anywhere);
an engine error crosses as :class:`RemoteError` and is raised again as the same type, so the
router's API answers exactly as the colocated server would.

>>> from server.engine.errors import Overloaded
>>> err = RemoteError.of(Overloaded("busy", retry_after=2.0, reason="queue_full")).exception()
>>> type(err).__name__, err.retry_after, err.reason
('Overloaded', 2.0, 'queue_full')
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, Field, RootModel, model_validator

from agentshare.protocol import AgentInfo
from server.engine.errors import (
    EngineError,
    InvalidRequest,
    Overloaded,
    PromptTooLong,
    UnknownModule,
)
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, Timeline, TokenEvent, Usage
from server.prompt import Prompt

Role = Literal["prefill", "decode"]


class WorkerError(EngineError):
    """A worker failed in a way that is not one of the engine's typed errors."""


class WorkerInfo(BaseModel):
    role: Role
    url: str
    family: str
    agents: list[AgentInfo]
    block_size: int
    max_context: int
    kv_dtype: str
    kv_bytes_per_token: int
    kv_address: dict[str, str] = Field(default_factory=dict)  # transport kind -> address (decode)
    threads: int
    pid: int
    hidden_depths: list[int] = Field(default_factory=list)  # layers whose input its pool keeps (layer split)


class LinkFigures(BaseModel):
    bytes: int = 0
    frames: int = 0
    transfers: int = 0
    failures: int = 0
    seconds: float = 0.0


class WorkerStats(BaseModel):
    role: Role
    prompt_tokens: int = 0  # the engine's counters: server.engine.config.EngineStats
    cached_prompt_tokens: int = 0
    imported_prompt_tokens: int = 0
    prefill_tokens: int = 0
    exported_prefill_tokens: int = 0
    exported_cached_tokens: int = 0
    decode_tokens: int = 0
    recomputed_prefix_tokens: int = 0
    split_saved_layer_rows: int = 0
    finished: int = 0
    waiting: int = 0
    running: int = 0
    contexts: int = 0
    blocks_capacity: int = 0
    blocks_held: int = 0
    blocks_free: int = 0
    blocks_evictable: int = 0
    bytes_held: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    inflight_hit_blocks: int = 0
    cross_module_hit_blocks: int = 0
    evictions: int = 0
    exported_blocks: int = 0  # prefill: blocks shipped to decode workers
    imported_blocks: int = 0  # decode: blocks received and committed
    imported_tokens: dict[str, int] = Field(default_factory=dict)  # decode: their tokens, by payload codec
    transfers_ok: int = 0
    transfers_failed: int = 0
    checksum_failures: int = 0
    refused_requests: int = 0  # internal calls without the cluster secret (401)
    refused_frames: int = 0  # KV connections whose frames failed authentication
    prefill_tok_s: float = 0.0  # measured by the engine (0: not yet)
    sent: dict[str, LinkFigures] = Field(default_factory=dict)  # per destination
    received: dict[str, LinkFigures] = Field(default_factory=dict)  # per source

    @property
    def bytes_sent(self) -> int:
        return sum(link.bytes for link in self.sent.values())

    @property
    def bytes_received(self) -> int:
        return sum(link.bytes for link in self.received.values())


class Lookup(BaseModel):
    token_ids: list[int]
    salt: str = ""
    prefix_codec: str | None = None


class Cached(BaseModel):
    cached_tokens: int
    waiting: int = 0
    running: int = 0
    occupancy: float = 0.0


class Expect(BaseModel):
    transfer_id: str
    token_ids: list[int]
    salt: str = ""
    prefix_codec: str | None = None
    timeout: float = 30.0
    hidden: bool = False  # the blocks come with the hidden state at every depth this worker keeps


class Expected(BaseModel):
    transfer_id: str
    first_block: int
    num_blocks: int  # blocks the decode worker waits for (0: it has them all)
    address: dict[str, str]


class TransferRef(BaseModel):
    transfer_id: str
    reason: str = ""


class Prefill(BaseModel):
    transfer_id: str
    token_ids: list[int]
    salt: str = ""
    first_block: int
    destination: str  # tcp://host:port or shm://host:port
    codec: str
    hidden_depths: list[int] = Field(default_factory=list)  # send the input of these layers too


class Prefilled(BaseModel):
    transfer_id: str
    blocks: int
    bytes: int
    seconds: float  # the whole order: queue, prefill, encode, send, ack
    link_seconds: float  # of which moving frames (what a link's bandwidth is measured by)
    computed_tokens: int
    cached_tokens: int


class Context(BaseModel):
    context_id: str
    token_ids: list[int]
    ttl: float
    salt: str = ""


class Join(BaseModel):
    url: str


class PromptFields(BaseModel):
    token_ids: list[int]
    context_len: int
    turn_start: int
    header_start: int

    @classmethod
    def of(cls, p: Prompt) -> PromptFields:
        return cls(token_ids=list(p.token_ids), context_len=p.context_len, turn_start=p.turn_start,
                   header_start=p.header_start)

    def prompt(self) -> Prompt:
        return Prompt(tuple(self.token_ids), self.context_len, self.turn_start, self.header_start)


class Explain(BaseModel):
    module: str
    prompt: PromptFields
    salt: str = ""


class Report(BaseModel):
    block_size: int
    blocks: int
    cached_blocks: int


class SamplingFields(RootModel[SamplingParams]):
    """A request's :class:`SamplingParams` whole, as the router sends it to a decode worker: every
    field of the dataclass travels and is validated again on arrival, so a new sampling field
    needs no edit here. A field this worker does not know is refused, never dropped (a router
    and a worker of different versions).

    >>> p = SamplingParams(temperature=0.5, stop=("x",), presence_penalty=1.0)
    >>> SamplingFields.model_validate_json(SamplingFields.of(p).model_dump_json()).params() == p
    True
    """

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - {f.name for f in dataclasses.fields(SamplingParams)})
            if unknown:
                raise ValueError(f"unknown sampling field(s) {unknown}: the router runs another version "
                                 "than this worker; run the same version on both")
        return data

    @classmethod
    def of(cls, p: SamplingParams) -> SamplingFields:
        return cls(p)

    def params(self) -> SamplingParams:
        return self.root


class Generate(BaseModel):
    request_id: str
    module: str
    prompt: PromptFields
    params: SamplingFields
    salt: str = ""
    prefix_codec: str | None = None


class Event(BaseModel):
    """One line of a ``/internal/generate`` stream: a TokenEvent."""

    token_id: int | None = None
    text: str = ""
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = Field(default_factory=list)
    finish_reason: str | None = None
    usage: tuple[int, int, int] | None = None  # prompt, cached, completion tokens
    error: str | None = None
    timeline: Timeline | None = None  # on the final line, whole (the router adds its part)

    @classmethod
    def of(cls, ev: TokenEvent) -> Event:
        u = ev.usage
        return cls(token_id=ev.token_id, text=ev.text, logprob=ev.logprob, top_logprobs=list(ev.top_logprobs),
                   finish_reason=None if ev.finish_reason is None else ev.finish_reason.value,
                   usage=None if u is None else (u.prompt_tokens, u.cached_tokens, u.completion_tokens),
                   error=ev.error, timeline=ev.timeline)

    def event(self, request_id: str) -> TokenEvent:
        return TokenEvent(request_id, self.token_id, self.text, self.logprob, list(self.top_logprobs),
                          None if self.finish_reason is None else FinishReason(self.finish_reason),
                          None if self.usage is None else Usage(*self.usage), self.error, self.timeline)


class RemoteError(BaseModel):
    """An engine error, as a worker reports it."""

    kind: str
    message: str
    retry_after: float = 1.0
    reason: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> RemoteError:
        return cls(kind=type(exc).__name__, message=str(exc), retry_after=getattr(exc, "retry_after", 1.0),
                   reason=getattr(exc, "reason", "") or "")

    def exception(self) -> EngineError:
        """The same error type the worker's engine raised, with its message."""
        if self.kind == "Overloaded":
            return Overloaded(self.message, self.retry_after, reason=self.reason or "queue_full")
        for cls in (PromptTooLong, UnknownModule):  # their constructors format the message themselves
            if self.kind == cls.__name__:
                exc = cls.__new__(cls)
                Exception.__init__(exc, self.message)
                return exc
        if self.kind in ("InvalidRequest", "ValidationError"):
            return InvalidRequest(self.message)
        return WorkerError(f"{self.kind}: {self.message}")

    @property
    def status(self) -> int:
        return {"Overloaded": 429, "PromptTooLong": 413, "UnknownModule": 404, "InvalidRequest": 422}.get(self.kind, 500)
