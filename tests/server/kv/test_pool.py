import hashlib

import anyio
import pytest

from server.kv.errors import BlockAborted, PoolExhausted, PoolInvariantError
from server.kv.keys import Layout, Namespace
from server.kv.pool import BlockPool, BlockState

from .conftest import FAMILY, serve

A = list(range(32))  # two blocks of 16
B = [7] * 16 + list(range(16))


def test_second_request_hits_the_whole_chain_and_partial_blocks_stay_private():
    pool = BlockPool(8, 16)
    assert serve(pool, A + [1, 2, 3])[0] == 0
    hit, held = serve(pool, A + [9, 9], release=False)
    assert hit == 2
    assert pool.block(held[-1]).state is BlockState.PRIVATE  # the partial block
    pool.release(held)
    assert pool.block(held[-1]).state is BlockState.FREE
    assert pool.stats.hit_blocks == 2 and pool.stats.miss_blocks == 2


def test_prefix_match_stops_at_first_differing_block():
    pool = BlockPool(8, 16)
    serve(pool, A + A)
    m = pool.match(A + [99] + A[1:], FAMILY)
    assert m.first_miss == 2 and m.num_cached_tokens == 32 and m.num_blocks == 4


def test_namespaces_and_salts_never_share_blocks():
    pool = BlockPool(16, 16)
    serve(pool, A)
    for other in (
        Layout(Namespace.family("g" * 64)),
        Layout(Namespace.family("f" * 64, salt="tenant-2")),
        Layout(Namespace.family("f" * 64).lossy("int8")),
    ):
        assert pool.match(A, other).num_cached_tokens == 0
    lossy = Layout(Namespace.family("f" * 64).lossy("int8"))
    serve(pool, A, lossy)
    assert pool.match(A, FAMILY).num_cached_tokens == 32  # exact blocks still there
    assert pool.match(A, lossy).num_cached_tokens == 32


def test_module_blocks_serve_their_module_only_and_family_blocks_count_cross_module_hits():
    pool = BlockPool(16, 16)
    fam = Namespace.family("f" * 64)
    planner = Layout(fam, Namespace.module("p" * 64, invocation_point=20))
    coder = Layout(fam, Namespace.module("c" * 64, invocation_point=20))
    serve(pool, A, planner, module="planner")
    # block 0 (positions < 16 <= IP) is the family's; block 1 straddles the IP: the planner's
    assert pool.match(A, coder).num_cached_tokens == 16
    assert pool.match(A, planner).num_cached_tokens == 32
    serve(pool, A, coder, module="coder")
    assert pool.stats.cross_module_hit_blocks == 1
    serve(pool, A, planner, module="planner")  # the planner computed block 0: not cross-module
    assert pool.stats.cross_module_hit_blocks == 1


def _ignores_parent(data: bytes) -> bytes:
    # A deliberately broken digest: keys depend on (namespace, tokens) but not on the parent.
    return hashlib.sha256(data[len(b"agentshare/block/v1") + 32 :]).digest()


def test_a_key_collision_on_the_parent_is_never_served():
    pool = BlockPool(8, 16, digest=_ignores_parent)
    serve(pool, [1] * 16 + [5] * 16)
    serve(pool, [2] * 16)
    # Block 1 of `other` has the same key as block 1 of the first request (the digest ignores
    # the parent) and the same tokens, but it was computed after [1]*16, not after [2]*16.
    other = [2] * 16 + [5] * 16
    assert pool.match(other, FAMILY).num_cached_tokens == 16
    assert serve(pool, other)[0] == 1
    # and the original is still served whole
    assert pool.match([1] * 16 + [5] * 16, FAMILY).num_cached_tokens == 32


def test_a_constant_digest_serves_nothing_wrong():
    pool = BlockPool(8, 16, digest=lambda data: b"\0" * 32)
    serve(pool, A)
    assert pool.match(B, FAMILY).num_cached_tokens == 0
    assert serve(pool, B)[0] == 0
    assert pool.match(A, FAMILY).num_cached_tokens == 16  # block 1 could not be indexed
    m = pool.match(A, FAMILY)
    assert pool.prefix_tokens(pool.block(m.block_ids[0])) == tuple(A[:16])


def test_refcounts_never_go_negative():
    pool = BlockPool(4, 16)
    _, held = serve(pool, A, release=False)
    pool.release(held)
    with pytest.raises(PoolInvariantError):
        pool.release(held[:1])
    assert all(pool.block(b).ref_count == 0 for b in held)


def test_lru_evicts_least_recently_used_and_chain_tails_first():
    pool = BlockPool(4, 16)
    serve(pool, A)  # blocks of A: 2
    serve(pool, B)  # blocks of B: 2, pool full
    serve(pool, A)  # A is now most recent
    serve(pool, [3] * 16)  # one eviction: B's tail goes first
    assert pool.match(B, FAMILY).num_cached_tokens == 16
    assert pool.match(A, FAMILY).num_cached_tokens == 32
    assert pool.stats.evictions == 1


def test_capacity_under_pressure_is_a_typed_error_that_changes_nothing():
    pool = BlockPool(4, 16)
    _, _held = serve(pool, A, release=False)  # 2 held
    serve(pool, B)  # 2 evictable
    before = pool.usage()
    with pytest.raises(PoolExhausted) as err:
        pool.allocate(3)
    assert (err.value.requested, err.value.available, err.value.capacity) == (3, 2, 4)
    assert pool.usage() == before and pool.match(B, FAMILY).num_cached_tokens == 32
    assert len(pool.allocate(2)) == 2  # evicting B is fine
    u = pool.usage()
    assert (u.free, u.held, u.evictable) == (0, 4, 0)


def test_the_room_left_once_a_match_is_held_does_not_count_its_own_evictable_blocks():
    pool = BlockPool(4, 16)
    serve(pool, A)  # 2 evictable, 2 free
    match = pool.match(A + [5] * 40, FAMILY)  # finds A's 2 blocks, misses 3
    assert pool.can_allocate(3) and pool.can_allocate(2, keeping=match.block_ids)
    assert not pool.can_allocate(3, keeping=match.block_ids)  # holding A takes 2 of the 4 blocks
    assert pool.can_allocate(2, keeping=[*match.block_ids, *match.block_ids])  # a block counts once
    pool.acquire(match, reader="x")
    with pytest.raises(PoolExhausted):
        pool.allocate(3)  # what the check above foresaw
    assert len(pool.allocate(2)) == 2 and pool.can_allocate(0, keeping=match.block_ids)


def test_pinned_blocks_are_not_evicted_until_unpinned(clock):
    pool = BlockPool(4, 16, clock=clock)
    _, held = serve(pool, A, release=False)
    pin = pool.pin(held, ttl=60)
    pool.release(held)
    with pytest.raises(PoolExhausted):
        pool.allocate(3)
    assert pool.unpin(pin) and not pool.unpin(pin)
    assert len(pool.allocate(4)) == 4


def test_pins_expire_after_their_ttl(clock):
    pool = BlockPool(2, 16, clock=clock)
    _, held = serve(pool, A, release=False)
    pool.pin(held, ttl=30)
    pool.release(held)
    clock.now += 29.9
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    clock.now += 0.1
    assert pool.allocate(2) and pool.pins == []


def test_usage_reports_bytes():
    pool = BlockPool(4, 16, bytes_per_block=1000)
    _, _held = serve(pool, A, release=False)
    serve(pool, B)
    u = pool.usage()
    assert (u.bytes_held, u.bytes_cached) == (2000, 2000)


@pytest.mark.anyio
async def test_concurrent_requests_for_one_prefix_wait_for_one_computation():
    pool = BlockPool(8, 16)
    computed: list[str] = []

    async def request(name: str, delay: float) -> list[int]:
        await anyio.sleep(delay)
        m = pool.match(A, FAMILY)
        pool.acquire(m, reader=name)
        fresh = pool.allocate(m.num_blocks - len(m.block_ids))
        pool.register(m, fresh, A, FAMILY, computed_by=name)
        if fresh:
            computed.append(name)
            await anyio.sleep(0.05)  # the "prefill"
            pool.commit(fresh)
        await pool.wait_ready(m.pending)
        assert all(pool.block(b).state is BlockState.READY for b in m.block_ids)
        return [*m.block_ids, *fresh]

    results: dict[str, list[int]] = {}
    async with anyio.create_task_group() as tg:
        for i, name in enumerate(("a", "b", "c")):
            async def run(name=name, i=i):
                results[name] = await request(name, i * 0.01)
            tg.start_soon(run)
    assert computed == ["a"]
    assert results["a"] == results["b"] == results["c"]
    assert pool.stats.inflight_hit_blocks == 4


@pytest.mark.anyio
async def test_waiters_of_an_aborted_block_get_a_typed_error_and_nothing_leaks():
    pool = BlockPool(8, 16)
    m1 = pool.match(A, FAMILY)
    pool.acquire(m1, reader="a")
    fresh = pool.allocate(2)
    pool.register(m1, fresh, A, FAMILY, computed_by="a")
    m2 = pool.match(A, FAMILY)
    pool.acquire(m2, reader="b")
    assert m2.pending == tuple(fresh)

    async def abort_soon():
        await anyio.sleep(0.01)
        pool.abort(fresh[0])

    async with anyio.create_task_group() as tg:
        tg.start_soon(abort_soon)
        with pytest.raises(BlockAborted):
            await pool.wait_ready(m2.pending)
    assert pool.match(A, FAMILY).num_cached_tokens == 0
    pool.abort(fresh[1])
    pool.release(fresh)
    pool.release(m2.block_ids)
    assert pool.usage().free == 8


def test_a_computing_block_dropped_by_every_holder_is_unindexed_and_freed():
    pool = BlockPool(4, 16)
    m = pool.match(A, FAMILY)
    fresh = pool.allocate(2)
    pool.register(m, fresh, A, FAMILY, computed_by="a")
    pool.release(fresh)  # e.g. the request was cancelled mid-prefill
    assert pool.match(A, FAMILY).num_cached_tokens == 0 and pool.usage().free == 4
    assert pool.stats.aborted_blocks == 2


def test_protocol_misuse_is_refused():
    pool = BlockPool(4, 16)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(PoolInvariantError):
        pool.commit([0])  # never allocated
    with pytest.raises(PoolInvariantError):
        pool.pin([0], ttl=5)  # not cached
    ids = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.pin(ids, ttl=0)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_contiguous_allocation_prefers_a_run_and_falls_back_to_lowest_ids():
    pool = BlockPool(10, 16)
    assert pool.allocate(3, contiguous=True) == [0, 1, 2]
    held = pool.allocate(7)
    pool.release([held[i] for i in (1, 3, 4, 5)])  # frees 4, 6, 7, 8
    assert sorted(pool.allocate(3, contiguous=True)) == [6, 7, 8]
    pool.release(held[:1])  # frees 3; free now {3, 4}
    assert pool.allocate(2, contiguous=True) == [3, 4]
    pool.release([0, 2])  # not a run
    assert pool.allocate(2, contiguous=True) == [0, 2]
    assert pool.usage().free == 0


def test_construction_defaults_and_limits():
    pool = BlockPool(1)
    assert (pool.capacity, pool.block_size, pool.bytes_per_block) == (1, 16, 0)
    assert BlockPool(2, block_size=1).block_size == 1
    for bad in ((0, 16), (2, 0), (2, -1)):
        with pytest.raises(ValueError):
            BlockPool(*bad)
    u = BlockPool(3, 16).usage()
    assert (u.capacity, u.free, u.held, u.evictable) == (3, 3, 0, 0)


def test_precomputed_keys_skip_hashing():
    calls = []

    def counting(data: bytes) -> bytes:
        calls.append(data)
        return hashlib.sha256(data).digest()

    pool = BlockPool(4, 16, digest=counting)
    keys = pool.keys(A, FAMILY)
    calls.clear()
    assert pool.match(A, FAMILY, keys=keys).keys == tuple(keys) and calls == []


def test_stats_accumulate_over_requests():
    pool = BlockPool(2, 16)
    serve(pool, A)
    serve(pool, A)
    serve(pool, A)
    assert (pool.stats.hit_blocks, pool.stats.miss_blocks) == (4, 2)  # two blocks a request
    serve(pool, B)  # evicts both of A's blocks
    serve(pool, A)  # and both of B's
    assert pool.stats.evictions == 4


def test_allocation_without_contiguous_takes_the_lowest_free_ids_and_with_it_a_run_of_two():
    pool = BlockPool(6, 16)
    held = pool.allocate(6)
    pool.release([held[i] for i in (0, 2, 3)])  # free {0, 2, 3}
    assert sorted(pool.allocate(2)) == [0, 2]  # lowest ids, not the run
    pool.release([0, 2])
    assert pool.allocate(2, contiguous=True) == [2, 3]  # the run, not the lowest ids


def test_register_refuses_blocks_that_are_not_held_private_ones():
    pool = BlockPool(4, 16)
    _, held = serve(pool, A, release=False)  # READY and held
    match = pool.match(B, FAMILY)
    with pytest.raises(PoolInvariantError):
        pool.register(match, held, B, FAMILY, computed_by="base")


def test_commit_skips_private_blocks_and_still_commits_the_rest():
    pool = BlockPool(4, 16)
    match = pool.match(A, FAMILY)
    pool.acquire(match, reader="base")
    ids = pool.allocate(2)
    assert pool.register(match, ids[1:], A, FAMILY, computed_by="base") == 1
    pool.commit(ids)  # ids[0] is private: skipped, ids[1] committed
    assert (pool.block(ids[0]).state, pool.block(ids[1]).state) == (BlockState.PRIVATE, BlockState.READY)


def test_a_stale_child_is_replaced_and_freed_when_nobody_holds_it():
    pool = BlockPool(3, 16)
    tokens = list(range(32))
    _, (head, child) = serve(pool, tokens, release=False)
    pool.release([head])  # the head is now the least recently used
    pool.release([child])
    filler = pool.allocate(2)  # one free block, then the head is evicted; the child stays cached
    assert pool.block(head).state is BlockState.PRIVATE and pool.block(child).state is BlockState.READY
    pool.release(filler)
    match = pool.match(tokens, FAMILY)
    assert match.block_ids == ()  # the child is unreachable without its parent
    pool.acquire(match, reader="base")
    fresh = pool.allocate(2)
    assert pool.register(match, fresh, tokens, FAMILY, computed_by="base") == 2  # the child's key is reclaimed
    pool.commit(fresh)
    assert child in fresh or pool.block(child).state is BlockState.FREE
    assert pool.match(tokens, FAMILY).block_ids == tuple(fresh)


def test_a_stale_child_still_held_becomes_private_to_its_holder():
    pool = BlockPool(4, 16)
    tokens = list(range(32))
    _, (head, child) = serve(pool, tokens, release=False)
    pool.release([head])  # the child stays held by its request
    pool.allocate(pool.usage().free)
    pool.allocate(1)  # evicts the head
    match = pool.match(tokens, FAMILY)
    pool.release([b for b in range(4) if b not in (child,) and pool.block(b).ref_count])
    pool.acquire(match, reader="base")
    fresh = pool.allocate(2)
    assert pool.register(match, fresh, tokens, FAMILY, computed_by="base") == 2
    assert pool.block(child).state is BlockState.PRIVATE and pool.block(child).key is None
    pool.release([child])
    assert pool.block(child).state is BlockState.FREE


def test_pin_queries_and_expiry_counts(clock):
    pool = BlockPool(4, 16, clock=clock)
    assert pool.next_pin_deadline() is None
    _, held = serve(pool, A, release=False)
    first, second = pool.pin(held, ttl=10), pool.pin(held, ttl=20)
    assert first.id != second.id and pool.is_pinned(first) and pool.is_pinned(second)
    assert pool.next_pin_deadline() == clock.now + 10
    clock.now += 30
    assert pool.expire_pins() == 2 and pool.expire_pins() == 0
    assert not pool.is_pinned(first) and pool.next_pin_deadline() is None


def test_a_head_freed_twice_never_serves_a_child_of_an_earlier_life():
    # Each life: the child stays held while its head is evicted and re-registered with the same
    # key; the child, keyed on the head's old generation, must not be served from the new head.
    pool = BlockPool(3, 16)
    _, (head, child) = serve(pool, A, release=False)
    for life in range(3):
        pool.release([head])  # the head alone becomes evictable
        ids = pool.allocate(2)  # the one free block, then the head is evicted and reused
        assert head in ids, life
        match = pool.match(A, FAMILY)
        assert match.block_ids == ()
        assert pool.register(match, [head], A, FAMILY, computed_by="base") == 1
        pool.commit([head])
        assert pool.match(A, FAMILY).block_ids == (head,), life  # the old child is stale
        match = pool.match(A, FAMILY)
        pool.acquire(match, reader="base")
        (new_child,) = (b for b in ids if b != head)
        assert pool.register(match, [new_child], A, FAMILY, computed_by="base") == 1
        pool.commit([new_child])
        assert pool.match(A, FAMILY).block_ids == (head, new_child), life
        assert pool.block(child).state is BlockState.PRIVATE  # replaced, kept for its holder
        pool.release([child, head])  # the old child is freed; the head keeps its allocation hold
        assert pool.block(child).state is BlockState.FREE
        child = new_child
