"""Everything one app serves with, built by the app factory: no module-level state.

>>> AgentCard("coder", "lora", family=None, shares_prefill=False).info().family is None
True
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from agentshare.protocol import AgentInfo
from server.api.config import ServerConfig
from server.api.contexts import ContextStore
from server.api.metrics import Metrics
from server.api.tenancy import Tenancy
from server.engine.core import EngineCore


@dataclass(frozen=True, slots=True)
class AgentCard:
    """What clients may know about one agent (decode module)."""

    name: str
    kind: str
    family: str | None
    shares_prefill: bool
    placement: str = "turn"
    reason: str = ""

    def info(self) -> AgentInfo:
        return AgentInfo(name=self.name, kind=self.kind, family=self.family,  # type: ignore[arg-type]
                         shares_prefill=self.shares_prefill, placement=self.placement,  # type: ignore[arg-type]
                         reason=self.reason)


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
            name: AgentCard(name, m.kind.value, core.family if m.shares_prefill else None,
                            m.shares_prefill, m.placement.value, m.reason)
            for name, m in core.modules.items()
        }
        return cls(core.family, agents, copy.deepcopy(core.tokenizer), core.config.block_size, core.max_context)


@dataclass(slots=True)
class ServerState:
    backend: Any  # server.api.backend.Backend (which imports this module)
    config: ServerConfig
    facts: EngineFacts
    tenancy: Tenancy
    metrics: Metrics
    contexts: ContextStore
    created: int = field(default_factory=lambda: int(time.time()))
    owns_backend: bool = False

    @property
    def fingerprint(self) -> str:
        return "fp_" + self.facts.family[:12]
