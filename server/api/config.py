"""What an agentshare server is started with: one frozen, keyword-only object.

>>> cfg = ServerConfig(api_keys=("k1",), max_waiting=8)
>>> cfg.engine_config().max_waiting, cfg.auth_required, cfg.pinned_share
(8, True, 1.0)
>>> ServerConfig(api_keys=("k1", "k2")).pinned_share  # several tenants: none may pin the whole pool
0.5
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from server.engine.core import EngineConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Server settings. ``model_dir=None`` serves the default model (SmolLM2-135M-Instruct)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_dir: Path | None = None
    modules: dict[str, Path] = field(default_factory=dict)  # agent name -> module directory
    base_name: str = "base"
    dtype: str = "auto"
    threads: int | None = None
    device: str = "auto"  # auto, cpu, cuda, cuda:N (server/engine/device.py)
    kv_cache_bytes: int | None = None  # None: the device's share (1 GiB on the CPU)
    memory_utilization: float = 0.9  # with kv_cache_bytes None on a CUDA device: its share for this engine
    block_size: int = 16
    max_step_tokens: int = 512
    max_running: int = 64
    max_waiting: int = 1024  # the queue limit: beyond it, 429
    step_timeout: float = 60.0  # an engine step running longer fails its requests; /health: degraded
    api_keys: tuple[str, ...] = ()  # none: one tenant, no auth
    log_level: str = "info"
    log_prompts: bool = False  # never log prompt text unless asked
    default_max_tokens: int = 256  # when a request gives no limit (KV is reserved up front)
    context_ttl: float = 600.0  # default TTL of a pinned context, seconds
    max_context_ttl: float = 24 * 3600.0
    max_pinned_contexts: int = 64  # per tenant: shared contexts pinned at once (beyond: 429)
    max_pinned_share: float | None = None  # per tenant: the fraction of the KV pool its pinned contexts
    # may hold; None: the whole pool with one tenant, half of it with several API keys
    keep_hidden: tuple[int, ...] = ()  # a prefill worker: layers whose input it keeps for split agents

    def __post_init__(self) -> None:
        if self.default_max_tokens <= 0 or self.context_ttl <= 0 or self.max_context_ttl < self.context_ttl:
            raise ValueError("default_max_tokens and context_ttl must be positive, max_context_ttl >= context_ttl")
        if self.max_pinned_contexts < 1 or not 0 < self.pinned_share <= 1:
            raise ValueError(f"max_pinned_contexts must be >= 1 (got {self.max_pinned_contexts}) and "
                             f"max_pinned_share in (0, 1] (got {self.max_pinned_share})")
        if any(not k for k in self.api_keys):
            raise ValueError("API keys must be non-empty strings")

    @property
    def auth_required(self) -> bool:
        return bool(self.api_keys)

    @property
    def pinned_share(self) -> float:
        """The fraction of the KV pool one tenant's pinned contexts may hold."""
        if self.max_pinned_share is not None:
            return self.max_pinned_share
        return 0.5 if len(self.api_keys) > 1 else 1.0

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            block_size=self.block_size, kv_cache_bytes=self.kv_cache_bytes,
            memory_utilization=self.memory_utilization,
            max_step_tokens=self.max_step_tokens, max_running=self.max_running,
            max_waiting=self.max_waiting, step_timeout=self.step_timeout, keep_hidden=self.keep_hidden,
        )
