"""What the API serves from: one local engine, or a router over worker processes.

The routes never touch an engine directly; they call a :class:`Backend`::

    routes ──▶ Backend ─┬─ LocalBackend   one AsyncEngine in this process (embedded, colocated)
                        └─ ClusterBackend prefill + decode workers (server.cluster.router)

Both stream the engine's own :class:`TokenEvent` objects, so rendering (OpenAI, native, SSE),
metrics and error mapping are one code path in every deployment mode.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

from server.api.metrics import EngineSnapshot
from server.api.state import EngineFacts
from server.engine.async_engine import AsyncEngine
from server.engine.sampling import SamplingParams
from server.engine.sequence import TokenEvent
from server.kv.pool import PrefixMatch
from server.prompt import Prompt


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


class LocalBackend:
    """One engine in this process (the embedded, colocated mode)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.facts = EngineFacts.of(engine.core)  # before serving: nothing else touches the core yet

    async def submit(
        self, request_id: str, module: str, prompt: Prompt, params: SamplingParams, *, salt: str = ""
    ) -> EventSource:
        return await self.engine.submit(request_id, module, prompt, params, salt=salt)

    async def add_context(self, context_id: str, token_ids: SequenceOf[int], *, ttl: float, salt: str = "") -> TokenEvent:
        return await self.engine.add_context(context_id, token_ids, ttl=ttl, salt=salt)

    async def release_context(self, context_id: str) -> bool:
        return await self.engine.run(lambda core: core.release_context(context_id))

    async def explain(self, module: str, prompt: Prompt, *, salt: str = "") -> CacheReport:
        return CacheReport.of(await self.engine.run(lambda core: core.explain(module, prompt, salt=salt)))

    async def snapshot(self) -> EngineSnapshot:
        return await self.engine.run(EngineSnapshot.of)

    def health(self) -> HealthReport:
        h = self.engine.health()
        return HealthReport(h.waiting, h.running, () if h.degraded is None else (h.degraded,))

    def close(self) -> None:
        self.engine.close()
