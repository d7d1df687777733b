"""The engine's knobs (:class:`EngineConfig`) and counters (:class:`EngineStats`).

>>> EngineConfig(block_size=16, max_step_tokens=256).share_prefill
True
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Engine knobs. ``share_prefill=False`` keys every cache by module, as engines do today
    (the baseline arm of the benchmarks)."""

    block_size: int = 16
    kv_cache_bytes: int | None = 1 << 30
    """The KV pool's size; None: the device's share (1 GiB on the CPU; on a CUDA device
    ``memory_utilization`` of its memory less what is in use, see ``server/engine/device.py``)."""
    memory_utilization: float = 0.9
    """With ``kv_cache_bytes`` None on a CUDA device: the fraction of the device's memory this
    engine may hold, weights and KV together (vLLM's ``gpu_memory_utilization``)."""
    max_step_tokens: int = 512
    """Tokens one step may compute while requests are decoding: a prefill is chunked so that it
    cannot stall their next tokens for long."""
    max_prefill_step_tokens: int = 2048
    """The budget of a step in which nothing decodes (a chunk then stalls nobody): bigger chunks
    prefill faster (2,048 tokens, default model, 2 threads: 0.72–0.78 s in chunks of 1,024 or
    2,048 against 0.84–0.92 s in chunks of 512). Never below ``max_step_tokens``."""
    prefill_tail_tokens: int = 128
    """In a step in which nothing decodes, a prompt whose rest exceeds the budget by at most
    this many tokens is finished in that step instead of leaving a short chunk for the next: a
    step reads every weight once whatever its size (default model, 2 threads: a 64-token step
    took 67 ms, the same 64 tokens inside a 2,048-token step about 22 ms). 0: never."""
    max_running: int = 64
    max_waiting: int = 1024
    decode_graphs: str = "auto"
    """Decode steps replayed from CUDA graphs (``server/engine/graphs.py``): ``auto`` (on a CUDA
    device, off elsewhere), ``off``, or ``padded`` (the padded steps without capture: tests)."""
    share_prefill: bool = True
    keep_hidden: tuple[int, ...] = ()
    """Layers whose input hidden state the pool keeps beyond those its own layer-split modules
    need: a prefill worker's, for the split agents of the decode workers it sends KV to."""
    step_timeout: float = 60.0
    """Seconds one step may run before the watchdog of :class:`AsyncEngine` fails its requests
    and reports the engine degraded (vLLM's iteration timeout is 60 s too)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_step_tokens <= 0 or self.max_running <= 0:
            raise ValueError("block_size, max_step_tokens and max_running must be positive")
        if self.max_prefill_step_tokens <= 0:
            raise ValueError("max_prefill_step_tokens must be positive")
        if self.prefill_tail_tokens < 0:
            raise ValueError("prefill_tail_tokens must be 0 or more")
        if self.decode_graphs not in ("auto", "off", "padded"):
            raise ValueError(f"decode_graphs is auto, off or padded, got {self.decode_graphs!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive (or None: the device's share), got {self.kv_cache_bytes}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must lie in (0, 1], got {self.memory_utilization}")
        if not self.step_timeout > 0:
            raise ValueError(f"step_timeout must be a positive number of seconds, got {self.step_timeout}")


@dataclass(slots=True)
class EngineStats:
    """Counters since start; tokens, not blocks.

    Two roles share one engine: requests it *serves* (role ``decode``: a decode worker's, the
    colocated server's, shared contexts) and *exported* prefills, run for a request another
    worker serves (role ``prefill``: a prefill worker's ``/internal/prefill`` job). For the
    requests served here, once their prompt is done::

        prompt_tokens = (prefill_tokens - exported_prefill_tokens)        computed here
                      + (cached_prompt_tokens - imported_prompt_tokens)   reused from this pool
                      + imported_prompt_tokens                            arrived over a link

    and for the exported jobs: their prefix = ``exported_prefill_tokens + exported_cached_tokens``.
    """

    prompt_tokens: int = 0  # once per request served here (exported prefills are not requests)
    cached_prompt_tokens: int = 0  # of those, not computed by their request: shared, cached, in flight
    imported_prompt_tokens: int = 0  # of cached: blocks imported over a link, on their first read
    prefill_tokens: int = 0  # prompt positions computed (both roles)
    exported_prefill_tokens: int = 0  # of prefill_tokens: for exported prefills (role prefill)
    exported_cached_tokens: int = 0  # exported prefills' positions found in this pool
    base_rows: int = 0  # positions computed with the base weights (prefill and decode)
    module_rows: int = 0  # positions computed with a module's weights (LoRA or full)
    recomputed_prefix_tokens: int = 0  # prefix positions a layer-split module filled: its top layers only
    split_saved_layer_rows: int = 0  # of those, the (position, layer) pairs it read from the family's blocks
    decode_tokens: int = 0
    steps: int = 0
    finished: int = 0
    replans: int = 0  # requests that re-planned after a block they awaited was abandoned
    prefill_tok_s: float = 0.0  # measured: EWMA over steps that were mostly prefill (0: none yet)

    def observe_step(self, rows: int, prefill_rows: int, seconds: float) -> None:
        """Fold one step into the prefill-throughput estimate (placement policies read it)."""
        if prefill_rows >= 32 and prefill_rows >= rows // 2 and seconds > 0:
            rate = rows / seconds
            self.prefill_tok_s = rate if not self.prefill_tok_s else 0.7 * self.prefill_tok_s + 0.3 * rate
