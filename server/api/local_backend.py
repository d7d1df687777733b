"""The local backend: one :class:`AsyncEngine` in this process (the embedded, colocated mode).

It implements :class:`server.backend.Backend`, the interface the routes call; the cluster's
router (:class:`server.cluster.router.ClusterBackend`) is the other implementation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceOf

from server.backend import CacheReport, EngineFacts, EngineSnapshot, EventSource, HealthReport
from server.engine.async_engine import AsyncEngine
from server.engine.core import EngineCore
from server.engine.sampling import SamplingParams
from server.engine.sequence import TokenEvent
from server.prompt import Prompt


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
        def explain(core: EngineCore) -> CacheReport:
            k, fill = core.explain_split(module, prompt, salt=salt)
            return dataclasses.replace(CacheReport.of(core.explain(module, prompt, salt=salt)),
                                       recompute_layers=k, fill_blocks=fill)

        return await self.engine.run(explain)

    async def snapshot(self) -> EngineSnapshot:
        return await self.engine.run(EngineSnapshot.of)

    def health(self) -> HealthReport:
        h = self.engine.health()
        return HealthReport(h.waiting, h.running, () if h.degraded is None else (h.degraded,))

    def close(self) -> None:
        self.engine.close()
