import pytest

from server.sim.cache import PrefixCache
from server.sim.workers import DecodeWorker, Link, LocalPrefill, PrefillWorker
from tests.server.sim.conftest import TOY


def test_link_store_and_forward_and_pipelined() -> None:
    link = Link(bandwidth_bytes_s=100.0, latency_s=1.0, layers=1)
    assert link.reserve(0.0, 5.0, 200) == 8.0  # after the prefill: 5 + 2 + 1
    assert link.queued_bytes(6.0) == 100.0 and link.queued_bytes(4.0) == 200.0
    assert link.reserve(5.0, 6.0, 100) == 9.0  # waits for the link (free at 7)
    piped = Link(bandwidth_bytes_s=100.0, layers=4)
    assert piped.reserve(0.0, 5.0, 200) == 5.5  # last layer's 50 bytes after the prefill
    assert piped.queued_bytes(1.0) == 200  # waiting on its prefill: not yet on the wire
    assert piped.reserve(0.0, 1.0, 1000) == 15.5  # link-bound: starts at 5.5
    assert piped.queued_bytes(10.5) == 500


def test_prefill_worker_is_fcfs() -> None:
    p = PrefillWorker(0, TOY, PrefixCache(4))
    assert p.enqueue(0.0, 500) == (0.0, 0.5)
    assert p.enqueue(0.1, 1000) == (0.5, 1.5)
    assert p.queue_depth(0.6) == 1 and p.queued_tokens(0.6) == 900


def test_decode_run_cut_exactly_on_a_step_boundary() -> None:
    d = DecodeWorker(0, TOY, PrefixCache(4))
    d.start_decode(1, 10)
    assert d.poke(0.0) == pytest.approx(1.0)  # 10 steps of 0.1 s as one event
    d.enqueue_prefill(LocalPrefill(2, 100, frozenset(), 1))
    assert d.poke(0.3) == pytest.approx(0.3)  # at the boundary itself: stop now
    assert d.poke(0.3) is None  # already cut
    res = d.finish_iteration()
    assert res.finished == [] and d.running == {1: 7}


def test_parked_request_waits_for_its_dependency() -> None:
    d = DecodeWorker(0, TOY, PrefixCache(4))
    assert d.kv_ready(2, frozenset({1}), 5) is False and d.queue_depth() == 1
    assert d.committed(1) == [2] and d.joiners == {2: 5}
    assert d.kv_ready(3, frozenset({1}), 0) is True and 3 not in d.joiners
