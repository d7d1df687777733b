"""The Mooncake conversation trace, and its replay through a block pool without a model.

Each trace request lists one hash id per 512-token block of its prompt; requests whose lists
start alike share that prefix. Replayed with ``block_size=1``, each hash id stands for one
block, so the pool's hit ratio is the trace's prefix-cache hit ratio at that capacity.

>>> from server.kv.pool import BlockPool
>>> reqs = [TraceRequest(0, 3, 1, (0, 1, 2)), TraceRequest(1, 2, 1, (0, 1))]
>>> replay(BlockPool(num_blocks=10, block_size=1), reqs).hit_ratio
0.4
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from server.kv.keys import Layout, Namespace
from server.kv.pool import BlockPool

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake trace."""

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
)
"""Where the trace lies relative to the project root (``../shared/traces/``)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path | str = DEFAULT_TRACE, *, limit: int | None = None) -> list[TraceRequest]:
    """Read the trace; raises ``FileNotFoundError`` naming the expected path when it is absent."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"trace not found at {path}; it ships in ../shared/traces/ beside the project root"
        )
    return list(_parse(path, limit))


def _parse(path: Path, limit: int | None) -> Iterator[TraceRequest]:
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and lineno > limit:
                return
            try:
                r = json.loads(line)
                yield TraceRequest(
                    int(r["timestamp"]),
                    int(r["input_length"]),
                    int(r["output_length"]),
                    tuple(int(h) for h in r["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: malformed trace record: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ReplayResult:
    hit_blocks: int
    total_blocks: int
    evictions: int
    skipped_requests: int  # requests larger than the whole pool (served uncached)

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def replay(
    pool: BlockPool, requests: Iterable[TraceRequest], *, namespace: Namespace | None = None
) -> ReplayResult:
    """Serve each request in turn through ``pool``: match, acquire, allocate, compute, release.

    Requests run one at a time (each releases its blocks before the next starts), so the result
    isolates the cache policy from concurrency. ``pool.block_size`` must be 1.
    """
    if pool.block_size != 1:
        raise ValueError("replay treats each hash id as one block: use block_size=1")
    layout = Layout(namespace or Namespace.family("mooncake-trace"))
    hits = total = skipped = 0
    evictions0 = pool.stats.evictions
    for req in requests:
        tokens = req.hash_ids
        total += len(tokens)
        match = pool.match(tokens, layout)
        hits += len(match.block_ids)
        missing = match.num_blocks - len(match.block_ids)
        pool.acquire(match, reader="trace")
        if not pool.can_allocate(missing):
            skipped += 1
            pool.release(match.block_ids)
            continue
        fresh = pool.allocate(missing)
        pool.register(match, fresh, tokens, layout, computed_by="trace")
        pool.commit(fresh)
        pool.release([*match.block_ids, *fresh])
    return ReplayResult(hits, total, pool.stats.evictions - evictions0, skipped)
