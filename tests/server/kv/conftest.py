from collections.abc import Sequence

import pytest

from server.kv.keys import Layout, Namespace
from server.kv.pool import BlockPool

FAMILY = Layout(Namespace.family("f" * 64))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def serve(
    pool: BlockPool, tokens: Sequence[int], layout: Layout = FAMILY, *, module: str = "base",
    release: bool = True,
) -> tuple[int, list[int]]:
    """One request through the pool: returns (cached blocks it hit, every block it held)."""
    match = pool.match(tokens, layout)
    pool.acquire(match, reader=module)
    partial = 1 if len(tokens) % pool.block_size else 0
    fresh = pool.allocate(match.num_blocks - len(match.block_ids) + partial)
    pool.register(match, fresh, tokens, layout, computed_by=module)
    pool.commit(fresh)
    held = [*match.block_ids, *fresh]
    if release:
        pool.release(held)
    return len(match.block_ids), held
