"""Snapshots: the frozen view of a request, the workers and the links that every policy reads.

Policies never touch live state. The caller (the simulator today, the router later) copies what
a decision needs into these dataclasses, calls a pure function and acts on the answer, so the
same function runs in tests on hand-made snapshots, in the simulator and in the server::

    RequestSnapshot ─┐
    WorkerSnapshot* ─┼─▶ place(...) ─▶ RouteDecision(decode=WorkerChoice, prefill=PrefillDecision)
    LinkSnapshot*   ─┘                          each with a target and a reason enum

All token counts are tokens of *this* request's prompt; byte counts are KV bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum


class Role(Enum):
    PREFILL = "prefill"
    """Runs the family's base model only: prefills and ships KV over a link."""
    DECODE = "decode"
    """Runs decode modules; can also prefill locally (chunked, mixed with decode steps)."""


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """What the policies need to know about one request.

    ``family`` is the prefill family of the request's decode module (docs/design.md §2), or None for a
    module that joined no family (a *foreign* module: it gets a private prefill).

    >>> RequestSnapshot(id=7, module="coder", family="fam", prompt_tokens=4096).prompt_tokens
    4096
    """

    id: int
    module: str
    family: str | None
    prompt_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError("a request has at least one prompt token")


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One worker as seen at decision time.

    ``cached_tokens`` is the longest prefix of *this request's* prompt that the worker's cache
    holds (or is computing) in a namespace the request may read. ``queued_tokens`` is prefill work
    ahead of a new arrival, in tokens; ``running`` the decode batch, counting requests placed there
    that will join it (KV in flight, prefill queued); ``occupancy`` the fraction of
    its KV memory held by live requests (0..1).

    >>> w = WorkerSnapshot(id=0, role=Role.DECODE, family="fam", cached_tokens=512)
    >>> w.incremental(2048)
    1536
    """

    id: int
    role: Role
    family: str
    cached_tokens: int = 0
    queue_depth: int = 0
    queued_tokens: int = 0
    running: int = 0
    occupancy: float = 0.0
    prefill_tok_s: float = 1.0
    """Prefill throughput, for time estimates (tokens per second)."""

    def __post_init__(self) -> None:
        if min(self.cached_tokens, self.queue_depth, self.queued_tokens, self.running) < 0:
            raise ValueError("worker counters are non-negative")
        if self.prefill_tok_s <= 0:
            raise ValueError("prefill_tok_s must be positive")

    def incremental(self, prompt_tokens: int) -> int:
        """Tokens this worker would compute to prefill the prompt (at least one: the last)."""
        return max(prompt_tokens - self.cached_tokens, 1)

    def queue_seconds(self) -> float:
        return self.queued_tokens / self.prefill_tok_s

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """Estimated time until this worker finishes the prompt: its queue, then the prompt."""
        return (self.queued_tokens + self.incremental(prompt_tokens)) / self.prefill_tok_s


@dataclass(frozen=True, slots=True)
class LinkSnapshot:
    """The egress link of one prefill worker (``prefill_id``) towards the decode side.

    >>> link = LinkSnapshot(prefill_id=0, bandwidth_bytes_s=1e9, latency_s=0.001, queued_bytes=5e8)
    >>> link.wait_seconds(), link.transfer_seconds(1e9)
    (0.5, 1.501)
    """

    prefill_id: int
    bandwidth_bytes_s: float
    latency_s: float = 0.0
    queued_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_s <= 0 or self.latency_s < 0 or self.queued_bytes < 0:
            raise ValueError("link bandwidth must be positive; latency and queue non-negative")

    def wait_seconds(self) -> float:
        """Time until bytes queued before a new transfer have left."""
        return self.queued_bytes / self.bandwidth_bytes_s

    def transfer_seconds(self, nbytes: float) -> float:
        """Time from now until ``nbytes`` enqueued now have arrived."""
        return self.wait_seconds() + nbytes / self.bandwidth_bytes_s + self.latency_s


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Everything one placement reads.

    ``family`` is the family the prefill workers' base model belongs to; ``kv_bytes_per_token``
    converts tokens to bytes on the links.
    """

    family: str
    kv_bytes_per_token: int
    prefill: Sequence[WorkerSnapshot] = ()
    decode: Sequence[WorkerSnapshot] = ()
    links: Sequence[LinkSnapshot] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if any(w.role is not Role.PREFILL for w in self.prefill):
            raise ValueError("ClusterSnapshot.prefill holds prefill workers only")
        if any(w.role is not Role.DECODE for w in self.decode):
            raise ValueError("ClusterSnapshot.decode holds decode workers only")

    def link_of(self, prefill_id: int) -> LinkSnapshot | None:
        for link in self.links:
            if link.prefill_id == prefill_id:
                return link
        return None
