"""Everything one app serves with, built by the app factory: no module-level state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from server.api.config import ServerConfig
from server.api.contexts import ContextStore
from server.api.metrics import Metrics
from server.api.tenancy import Tenancy
from server.backend import Backend, EngineFacts


@dataclass(slots=True)
class ServerState:
    backend: Backend
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
