"""Random request/release/pin sequences against a model of the pool built on *content*.

The reference keys cached blocks by (namespace, the whole token prefix) — no hashing, no
chaining, no block ids — and keeps LRU order with a release counter. Whatever the pool does
with chained digests, parents and free lists must agree with it.
"""

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from server.kv.errors import PoolExhausted
from server.kv.keys import Layout, Namespace
from server.kv.pool import BlockPool

from .conftest import FakeClock

BS = 2
CAPACITY = 7
FAM = Namespace.family("f" * 64)
LAYOUTS = [
    Layout(FAM),
    Layout(Namespace.family("g" * 64)),
    Layout(Namespace.family("f" * 64, salt="t2")),
    Layout(FAM, Namespace.module("m" * 64, invocation_point=3)),
]
tokens_st = st.lists(st.integers(0, 1), min_size=0, max_size=9)


def content(layout: Layout, tokens, i: int):
    return (layout.namespace_of(i, block_size=BS), tuple(tokens[: (i + 1) * BS]))


@dataclass
class Model:
    refs: dict = field(default_factory=dict)  # content -> refcount (cached blocks only)
    released_at: dict = field(default_factory=dict)  # content -> tick of its last release to 0
    private: int = 0  # held partial blocks
    tick: int = 0

    def cached_prefix(self, layout, tokens) -> int:
        n = 0
        while n < len(tokens) // BS and content(layout, tokens, n) in self.refs:
            n += 1
        return n

    def available(self) -> int:
        return CAPACITY - self.private - sum(1 for r in self.refs.values() if r > 0)

    def evict(self, need: int) -> None:
        while CAPACITY - len(self.refs) - self.private < need:
            victim = min((c for c, r in self.refs.items() if r == 0), key=self.released_at.get)
            del self.refs[victim], self.released_at[victim]

    def release(self, contents) -> None:
        for c in reversed(contents):
            self.refs[c] -= 1
            if self.refs[c] == 0:
                self.tick += 1
                self.released_at[c] = self.tick


class PoolMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.clock = FakeClock()
        self.pool = BlockPool(CAPACITY, BS, clock=self.clock)
        self.model = Model()
        self.requests: list[tuple[list[int], list, bool]] = []  # (block ids, contents, partial)
        self.pins: list[tuple[object, list, float]] = []

    def _expire(self):
        # the pool releases expired pins earliest deadline first (ties: pinned first)
        for entry in sorted((p for p in self.pins if p[2] <= self.clock.now), key=lambda p: p[2]):
            self.pins.remove(entry)
            self.model.release(entry[1])

    @rule(layout=st.sampled_from(LAYOUTS), tokens=tokens_st)
    def request(self, layout, tokens):
        m = self.pool.match(tokens, layout)
        assert len(m.block_ids) == self.model.cached_prefix(layout, tokens)
        for i, bid in enumerate(m.block_ids):  # every hit is exactly the requested content
            b = self.pool.block(bid)
            assert (b.namespace, self.pool.prefix_tokens(b)) == content(layout, tokens, i)
        self.pool.acquire(m, reader="r")
        hits = [content(layout, tokens, i) for i in range(len(m.block_ids))]
        for c in hits:
            self.model.refs[c] += 1
        partial = len(tokens) % BS != 0
        need = m.num_blocks - len(m.block_ids) + partial
        self._expire()
        if need > self.model.available():
            try:
                self.pool.allocate(need)
                raise AssertionError("allocation should have failed")
            except PoolExhausted:
                pass
            self.pool.release(m.block_ids)
            self.model.release(hits)
            return
        self.model.evict(need)
        fresh = self.pool.allocate(need)
        assert self.pool.register(m, fresh, tokens, layout, computed_by="r") == need - partial
        self.pool.commit(fresh)
        new = [content(layout, tokens, i) for i in range(len(m.block_ids), m.num_blocks)]
        for c in new:
            self.model.refs[c] = 1
        self.model.private += partial
        self.requests.append(([*m.block_ids, *fresh], hits + new, partial))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data):
        ids, contents, partial = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.pool.release(ids)
        self.model.release(contents)
        self.model.private -= partial

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), ttl=st.sampled_from([1.0, 5.0]))
    def pin(self, data, ttl):
        ids, contents, _partial = self.requests[data.draw(st.integers(0, len(self.requests) - 1))]
        cached = ids[: len(contents)]
        pin = self.pool.pin(cached, ttl=ttl)
        for c in contents:
            self.model.refs[c] += 1
        self.pins.append((pin, contents, self.clock.now + ttl))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        entry = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        assert self.pool.unpin(entry[0])
        self.model.release(entry[1])

    @rule(dt=st.sampled_from([0.5, 2.0]))
    def advance(self, dt):
        self.clock.now += dt

    @invariant()
    def usage_agrees(self):
        u = self.pool.usage()
        assert u.free + u.held + u.evictable == CAPACITY
        held_model = self.model.private + sum(1 for r in self.model.refs.values() if r > 0)
        assert u.held == held_model
        assert u.evictable == sum(1 for r in self.model.refs.values() if r == 0)
        assert all(self.pool.block(i).ref_count >= 0 for i in range(CAPACITY))

    @invariant()
    def cached_contents_agree(self):
        got = {(b.namespace, self.pool.prefix_tokens(b)): b.ref_count for b in self.pool.indexed()}
        assert got == self.model.refs


TestPool = PoolMachine.TestCase
TestPool.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _one_byte(data: bytes) -> bytes:
    import hashlib

    return hashlib.sha256(data).digest()[:1]  # 256 keys in all: collisions everywhere


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(LAYOUTS), st.lists(st.integers(0, 3), max_size=12), st.booleans()),
        max_size=40,
    )
)
def test_a_weak_digest_never_serves_foreign_content(ops):
    pool = BlockPool(CAPACITY * 2, BS, digest=_one_byte)
    open_requests: list[list[int]] = []
    for layout, tokens, keep in ops:
        m = pool.match(tokens, layout)
        for i, bid in enumerate(m.block_ids):
            b = pool.block(bid)
            assert (b.namespace, pool.prefix_tokens(b)) == content(layout, tokens, i)
        pool.acquire(m, reader="r")
        need = m.num_blocks - len(m.block_ids) + (len(tokens) % BS != 0)
        if not pool.can_allocate(need):
            pool.release(m.block_ids)
            continue
        fresh = pool.allocate(need)
        pool.register(m, fresh, tokens, layout, computed_by="r")
        pool.commit(fresh)
        held = [*m.block_ids, *fresh]
        if keep:
            open_requests.append(held)
        else:
            pool.release(held)
        u = pool.usage()
        assert u.free + u.held + u.evictable == pool.capacity
    for held in open_requests:
        pool.release(held)
    assert pool.usage().held == 0
