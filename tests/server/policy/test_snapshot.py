import pytest

from server.policy import ClusterSnapshot, LinkSnapshot, RequestSnapshot, Role, WorkerSnapshot


def test_incremental_prefill_is_at_least_one_token() -> None:
    w = WorkerSnapshot(0, Role.DECODE, "fam", cached_tokens=4096)
    assert w.incremental(4096) == 1 and w.incremental(4097) == 1 and w.incremental(5000) == 904


def test_estimates() -> None:
    w = WorkerSnapshot(0, Role.PREFILL, "fam", cached_tokens=100, queued_tokens=300, prefill_tok_s=100)
    assert w.queue_seconds() == 3.0 and w.prefill_seconds(200) == 4.0
    link = LinkSnapshot(0, bandwidth_bytes_s=100.0, latency_s=0.5, queued_bytes=200.0)
    assert link.wait_seconds() == 2.0 and link.transfer_seconds(100) == 3.5


@pytest.mark.parametrize(
    "make",
    [
        lambda: RequestSnapshot(0, "m", "fam", 0),
        lambda: WorkerSnapshot(0, Role.DECODE, "fam", cached_tokens=-1),
        lambda: WorkerSnapshot(0, Role.DECODE, "fam", prefill_tok_s=0),
        lambda: LinkSnapshot(0, bandwidth_bytes_s=0),
        lambda: LinkSnapshot(0, bandwidth_bytes_s=1, queued_bytes=-1),
        lambda: ClusterSnapshot("fam", 1, prefill=[WorkerSnapshot(0, Role.DECODE, "fam")]),
        lambda: ClusterSnapshot("fam", 1, decode=[WorkerSnapshot(0, Role.PREFILL, "fam")]),
    ],
)
def test_invalid_snapshots_are_refused(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        make()


def test_link_lookup() -> None:
    c = ClusterSnapshot("fam", 1, links=[LinkSnapshot(3, 1.0), LinkSnapshot(5, 2.0)])
    assert c.link_of(5).bandwidth_bytes_s == 2.0 and c.link_of(4) is None  # type: ignore[union-attr]
