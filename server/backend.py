"""The serving backend's interface: what the API serves from, and what it learns about it.

The routes never touch an engine directly; they call a :class:`Backend`::

    server.api (routes) ──▶ Backend ─┬─ LocalBackend    one AsyncEngine in this process
                                     │                  (server.api.local_backend: embedded, colocated)
                                     └─ ClusterBackend  prefill + decode workers
                                                        (server.cluster.router)

Both stream the engine's own :class:`~server.engine.sequence.TokenEvent` objects, so rendering
(OpenAI, native, SSE), metrics and error mapping are one code path in every deployment mode.
This module holds the contract and the plain records that cross it (:class:`EngineFacts`,
:class:`AgentCard`, :class:`EngineSnapshot`, :class:`CacheReport`, :class:`HealthReport`); it
imports neither implementation, and both import it.

>>> AgentCard("coder", "lora", family=None, shares_prefill=False).info().family is None
True
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentshare.protocol import AgentInfo, Fidelity
from server.engine.core import EngineCore
from server.engine.sampling import SamplingParams
from server.engine.sequence import TokenEvent
from server.kv.pool import PrefixMatch
from server.prompt import Prompt


@dataclass(frozen=True, slots=True)
class AgentCard:
    """What clients may know about one agent (decode module)."""

    name: str
    kind: str
    family: str | None
    shares_prefill: bool
    placement: str = "turn"
    reason: str = ""
    recompute_layers: int = 0  # top layers it recomputes over the shared prefix (the layer split)
    fidelity: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    """What sharing costs it, as ``finetune --fidelity`` measured (its manifest's record)."""

    @property
    def is_base(self) -> bool:
        return self.kind == "base"

    def info(self) -> AgentInfo:
        return AgentInfo(name=self.name, kind=self.kind, family=self.family,
                         shares_prefill=self.shares_prefill, placement=self.placement,  # type: ignore[arg-type]
                         reason=self.reason, recompute_layers=self.recompute_layers,
                         fidelity=None if self.fidelity is None else Fidelity.model_validate(self.fidelity))


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """Immutable facts about the engine, read once on its thread."""

    family: str
    agents: dict[str, AgentCard]
    tokenizer: Any  # the API's own copy: a fast tokenizer must not be shared across threads
    block_size: int
    max_context: int

    @classmethod
    def of(cls, core: EngineCore) -> EngineFacts:
        agents = {
            name: AgentCard(name, str(m.kind), core.family if m.shares_prefill else None,
                            m.shares_prefill, str(m.placement), m.reason, m.recompute_layers, m.fidelity)
            for name, m in core.modules.items()
        }
        return cls(core.family, agents, copy.deepcopy(core.tokenizer), core.config.block_size, core.max_context)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSnapshot:
    """The engine's counters and gauges at one instant (taken on the engine thread; a cluster
    backend sums its workers': every token counter has one meaning, so the sums count no token
    twice; see :class:`~server.engine.config.EngineStats` for the identities).

    >>> s = EngineSnapshot(prompt_tokens=100, cached_prompt_tokens=64, imported_prompt_tokens=48,
    ...                    prefill_tokens=100, exported_prefill_tokens=64)
    >>> s.computed_prompt_tokens, s.reused_prompt_tokens, s.imported_prompt_tokens
    (36, 16, 48)
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    imported_prompt_tokens: int = 0
    prefill_tokens: int = 0
    exported_prefill_tokens: int = 0
    exported_cached_tokens: int = 0
    decode_tokens: int = 0
    recomputed_prefix_tokens: int = 0
    split_saved_layer_rows: int = 0
    finished: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    inflight_hit_blocks: int = 0
    cross_module_hit_blocks: int = 0
    evictions: int = 0
    blocks_capacity: int = 0
    blocks_free: int = 0
    blocks_held: int = 0
    blocks_evictable: int = 0
    bytes_held: int = 0
    waiting: int = 0
    running: int = 0
    contexts: int = 0

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens of the requests served here that their engine computed (role decode)."""
        return self.prefill_tokens - self.exported_prefill_tokens

    @property
    def reused_prompt_tokens(self) -> int:
        """Prompt tokens read from the serving engine's own pool (shared, cached, in flight)."""
        return self.cached_prompt_tokens - self.imported_prompt_tokens

    @classmethod
    def of(cls, core: EngineCore) -> EngineSnapshot:
        s, p, u = core.stats, core.pool.stats, core.pool.usage()
        return cls(
            prompt_tokens=s.prompt_tokens, cached_prompt_tokens=s.cached_prompt_tokens,
            imported_prompt_tokens=s.imported_prompt_tokens, exported_prefill_tokens=s.exported_prefill_tokens,
            exported_cached_tokens=s.exported_cached_tokens,
            prefill_tokens=s.prefill_tokens, decode_tokens=s.decode_tokens, finished=s.finished,
            recomputed_prefix_tokens=s.recomputed_prefix_tokens, split_saved_layer_rows=s.split_saved_layer_rows,
            hit_blocks=p.hit_blocks, miss_blocks=p.miss_blocks, inflight_hit_blocks=p.inflight_hit_blocks,
            cross_module_hit_blocks=p.cross_module_hit_blocks, evictions=p.evictions,
            blocks_capacity=u.capacity, blocks_free=u.free, blocks_held=u.held,
            blocks_evictable=u.evictable, bytes_held=u.bytes_held,
            waiting=len(core.waiting), running=len(core.running), contexts=len(core.contexts),
        )


@dataclass(frozen=True, slots=True)
class CacheReport:
    """What the cache holds for one request's prompt: its full blocks, and how many would hit.

    >>> r = CacheReport(block_size=16, blocks=4, cached_blocks=3)
    >>> r.cached_tokens, r.first_miss
    (48, 3)
    """

    block_size: int
    blocks: int
    cached_blocks: int
    recompute_layers: int = 0
    """A layer-split module's recomputed top layers (0: it reads every layer of the base's KV)."""
    fill_blocks: int = 0
    """Of the blocks past the cached ones, those a layer-split module would fill from the
    family's cache: their lower layers read, only its top layers recomputed."""

    @property
    def cached_tokens(self) -> int:
        return self.cached_blocks * self.block_size

    @property
    def first_miss(self) -> int | None:
        """Index of the first full block that would not hit; None if all would."""
        return None if self.cached_blocks == self.blocks else self.cached_blocks

    @classmethod
    def of(cls, match: PrefixMatch) -> CacheReport:
        return cls(match.block_size, match.num_blocks, len(match.block_ids))


@dataclass(frozen=True, slots=True)
class HealthReport:
    """What ``/health`` says, read without waiting on any engine: queue figures, and why some
    agent cannot be served now (empty: every one can).

    >>> HealthReport(waiting=0, running=2).degraded
    ()
    """

    waiting: int
    running: int
    degraded: tuple[str, ...] = ()


class EventSource(Protocol):
    """The events of one submitted request. ``cancel()`` is synchronous (safe in cleanup code
    running inside a cancelled scope) and frees the request's KV wherever it runs."""

    finished: bool

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...

    def cancel(self) -> None: ...


class Backend(Protocol):
    """What the API serves from (a local engine, or a router over workers)."""

    facts: EngineFacts

    async def submit(
        self, request_id: str, module: str, prompt: Prompt, params: SamplingParams, *, salt: str = ""
    ) -> EventSource:
        """Queue a request; raise the engine's typed error (bad input, overload) before any event."""
        ...

    async def add_context(self, context_id: str, token_ids: SequenceOf[int], *, ttl: float, salt: str = "") -> TokenEvent:
        """Prefill and pin a shared context; its final (PREFILLED) event."""
        ...

    async def release_context(self, context_id: str) -> bool: ...

    async def explain(self, module: str, prompt: Prompt, *, salt: str = "") -> CacheReport: ...

    async def snapshot(self) -> EngineSnapshot: ...

    def health(self) -> HealthReport:
        """Never blocks: a stuck engine must still be reported."""
        ...

    def close(self) -> None: ...
