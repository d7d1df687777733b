"""The vllm engine's prefix KV store (no vLLM needed): keys, checks, pins, eviction, counters."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from server.kv.keys import Layout, Namespace
from server.vllm.store import KVStore, open_store, prefix_blocks

FAMILY = "f" * 64


def _store(tmp_path: Path, capacity: int = 1 << 20, role: str = "t") -> KVStore:
    return KVStore(tmp_path, fmt="fmt", capacity_bytes=capacity, role=role)


def _kv(value: float, nbytes: int = 4096) -> np.ndarray:
    return np.full((nbytes // 4,), value, np.float32).view(np.uint8).reshape(2, -1)


def test_prefix_blocks_use_the_engines_block_keys_and_key_the_tail() -> None:
    tokens = list(range(300))
    blocks = prefix_blocks(tokens, family=FAMILY, salt="s", block_size=128)
    assert [(b.start, b.end) for b in blocks] == [(0, 128), (128, 256), (256, 300)]
    full = Layout(Namespace.family(FAMILY, salt="s")).block_keys(tokens, block_size=128)
    assert [b.key for b in blocks[:2]] == full  # the project's one key function
    assert blocks[2].parent == full[-1]
    # another tail, another salt, another family: other keys
    assert prefix_blocks(tokens[:299], family=FAMILY, salt="s", block_size=128)[2].key != blocks[2].key
    assert prefix_blocks(tokens, family=FAMILY, salt="t", block_size=128)[0].key != blocks[0].key
    assert prefix_blocks(tokens, family="e" * 64, salt="s", block_size=128)[0].key != blocks[0].key


def test_a_block_is_served_only_to_the_key_parent_and_tokens_it_was_written_for(tmp_path: Path) -> None:
    store = _store(tmp_path)
    b = prefix_blocks(list(range(20)), family=FAMILY, salt="", block_size=16)[1]
    assert store.put(b.key, parent=b.parent, tokens=list(range(16, 20)), kv=_kv(1.0))
    assert not store.put(b.key, parent=b.parent, tokens=list(range(16, 20)), kv=_kv(2.0))  # written once
    got = store.get(b.key, parent=b.parent, tokens=list(range(16, 20)))
    assert got is not None and (got.view(np.float32) == 1.0).all()
    assert store.get(b.key, parent=bytes(32), tokens=list(range(16, 20))) is None
    assert store.get(b.key, parent=b.parent, tokens=[16, 17, 18, 99]) is None
    assert store.counters.rejected_blocks == 2 and store.counters.loaded_blocks == 1


def test_a_corrupted_block_is_a_miss(tmp_path: Path) -> None:
    store = _store(tmp_path)
    key = bytes(range(32))
    store.put(key, parent=bytes(32), tokens=[1], kv=_kv(3.0))
    path = store.blocks / key.hex()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(key, parent=bytes(32), tokens=[1]) is None
    assert store.counters.rejected_blocks == 1


def test_eviction_keeps_the_store_within_capacity_least_recently_used_first_and_spares_pins(tmp_path: Path) -> None:
    probe = _store(tmp_path / "probe")
    probe.put(bytes(32), parent=bytes(32), tokens=[0], kv=_kv(0.0))
    one = probe.usage()[1]  # one block's file: header + payload
    store = _store(tmp_path, capacity=3 * one)
    keys = [bytes([i]) * 32 for i in range(5)]
    for i, k in enumerate(keys):
        store.put(k, parent=bytes(32), tokens=[i], kv=_kv(float(i)))
        os.utime(store.blocks / k.hex(), (time.time() - 100 + i, time.time() - 100 + i))
    store.get(keys[0], parent=bytes(32), tokens=[0])  # used just now: evicted last
    store.pin("req-1", [keys[1]], ttl=60)
    store.evict()
    kept = {k for k in keys if store.contains(k)}
    assert kept == {keys[0], keys[1], keys[4]}
    assert store.usage()[1] <= 3 * one and store.counters.evicted_blocks == 2
    store.unpin("req-1")
    store.pin("old", [keys[4]], ttl=-1)  # an expired pin protects nothing and is removed
    store.put(bytes([9]) * 32, parent=bytes(32), tokens=[9], kv=_kv(9.0))
    store.evict()
    assert not (store.pins / "old").exists()
    assert store.usage()[1] <= 3 * one


def test_counters_of_every_process_add_up(tmp_path: Path) -> None:
    a, b = _store(tmp_path, role="a"), _store(tmp_path, role="b")
    a.put(bytes(32), parent=bytes(32), tokens=[1], kv=_kv(1.0))
    b.get(bytes(32), parent=bytes(32), tokens=[1])
    a.publish()
    b.publish()
    total = a.counters_total()
    assert (total.saved_blocks, total.loaded_blocks) == (1, 1)
    assert total.saved_bytes == total.loaded_bytes == _kv(1.0).nbytes


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        KVStore(tmp_path, fmt="x", capacity_bytes=0, role="t")
    with pytest.raises(ValueError, match="pin name"):
        _store(tmp_path).pin("../x", [], ttl=1)


def _one_block_bytes(tmp_path: Path) -> int:
    """The size of one ``_kv`` block's file (header and payload)."""
    probe = _store(tmp_path / "probe")
    probe.put(bytes(32), parent=bytes(32), tokens=[0], kv=_kv(0.0))
    return probe.usage()[1]


def _fill(store: KVStore, n: int) -> list[bytes]:
    """``n`` blocks, the first least recently used."""
    keys = [bytes([i + 1]) * 32 for i in range(n)]
    for i, k in enumerate(keys):
        store.put(k, parent=bytes(32), tokens=[i], kv=_kv(float(i)))
        os.utime(store.blocks / k.hex(), (time.time() - 100 + i, time.time() - 100 + i))
    return keys


def test_a_prefix_of_whole_blocks_has_no_tail() -> None:
    blocks = prefix_blocks(list(range(32)), family=FAMILY, salt="", block_size=16)
    assert [(b.start, b.end) for b in blocks] == [(0, 16), (16, 32)]
    assert prefix_blocks([], family=FAMILY, salt="", block_size=16) == []


def test_the_files_are_where_the_layout_says(tmp_path: Path) -> None:
    """Other processes (the vLLM instances, the node) find blocks, pins and counters by these paths."""
    store = KVStore(tmp_path, fmt="layout-a", capacity_bytes=1, role="node")  # one byte is a capacity
    assert store.fmt == "layout-a"
    key = bytes(range(32))
    store.put(key, parent=bytes(32), tokens=[1], kv=_kv(1.0))
    store.pin("req", [key], ttl=60)
    store.publish()
    fmt_dir = tmp_path / "layout-a"
    assert (fmt_dir / "blocks" / key.hex()).is_file()
    assert json.loads((fmt_dir / "pins" / "req").read_text())["keys"] == [key.hex()]
    assert json.loads((fmt_dir / "stats" / f"node-{os.getpid()}.json").read_text())["saved_blocks"] == 1


def test_counters_add_up_every_put_and_get(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put(bytes(32), parent=bytes(32), tokens=[1], kv=_kv(1.0, 4096))
    store.put(bytes([1]) * 32, parent=bytes(32), tokens=[2], kv=_kv(2.0, 1024))
    for _ in range(3):
        store.get(bytes(32), parent=bytes(32), tokens=[1])
    c = store.counters
    assert (c.saved_blocks, c.saved_bytes) == (2, 4096 + 1024)
    assert (c.loaded_blocks, c.loaded_bytes) == (3, 3 * 4096)


def test_a_block_of_another_file_format_or_truncated_is_a_miss(tmp_path: Path) -> None:
    store = _store(tmp_path)
    key = bytes(range(32))
    store.put(key, parent=bytes(32), tokens=[1], kv=_kv(3.0))
    path = store.blocks / key.hex()
    whole = path.read_bytes()
    path.write_bytes(b"X" + whole[1:])  # another magic: everything else as written
    assert store.get(key, parent=bytes(32), tokens=[1]) is None
    for cut in (3, 11, 13, 20):  # in the magic, in the header's length, in the header
        path.write_bytes(whole[:cut])
        assert store.get(key, parent=bytes(32), tokens=[1]) is None
    assert store.counters.rejected_blocks == 5 and store.counters.loaded_blocks == 0
    path.write_bytes(whole)
    assert store.get(key, parent=bytes(32), tokens=[1]) is not None


def test_a_block_evicted_just_after_it_was_read_is_still_served(tmp_path: Path, monkeypatch) -> None:
    """Another process evicts the block between the read and the touch: the read stands."""
    store = _store(tmp_path)
    store.put(bytes(32), parent=bytes(32), tokens=[1], kv=_kv(1.0))
    utime = os.utime

    def evicted_first(path, *args, **kwargs):
        os.unlink(path)
        return utime(path, *args, **kwargs)

    monkeypatch.setattr(os, "utime", evicted_first)
    got = store.get(bytes(32), parent=bytes(32), tokens=[1])
    assert got is not None and (got.view(np.float32) == 1.0).all()
    assert store.counters.loaded_blocks == 1 and not store.contains(bytes(32))


def test_pin_names_that_could_leave_the_pins_directory_or_hide_are_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for name in ("", "a/b", ".hidden", "..", "/abs"):
        with pytest.raises(ValueError, match="pin name"):
            store.pin(name, [], ttl=1)
    assert list(store.pins.iterdir()) == []
    store.unpin("never-pinned")  # nothing to drop: not an error
    store.pin("ok", [], ttl=1)
    store.unpin("ok")
    store.unpin("ok")
    assert list(store.pins.iterdir()) == []


def test_only_live_well_formed_pins_protect(tmp_path: Path) -> None:
    """Pins being written (temporary names), unreadable, expired, without an expiry or without keys
    protect nothing, wherever they come among the valid ones; the expired ones are removed."""
    store = _store(tmp_path, capacity=1)
    kept = _fill(store, 6)
    victims = [bytes([100 + i]) * 32 for i in range(6)]
    for i, v in enumerate(victims):
        store.put(v, parent=bytes(32), tokens=[i], kv=_kv(0.5))
    future = time.time() + 60
    for i, k in enumerate(kept):
        (store.pins / f".w{i}.tmp").write_text(json.dumps({"expires": future, "keys": [victims[0].hex()]}))
        store.pin(f"p{i}", [k], ttl=60)
        (store.pins / f"bad{i}").write_text("{not json")
        store.pin(f"old{i}", [victims[1]], ttl=-1)
        (store.pins / f"noexp{i}").write_text(json.dumps({"keys": [victims[2].hex()]}))
        (store.pins / f"nokeys{i}").write_text(json.dumps({"expires": future}))
    assert store.evict() == len(victims)
    assert {k for k in kept + victims if store.contains(k)} == set(kept)
    left = {p.name for p in store.pins.iterdir()}
    assert not any(n.startswith(("old", "noexp")) for n in left)
    assert {f"p{i}" for i in range(6)} <= left and ".w0.tmp" in left


def test_a_pin_holds_until_the_instant_it_expires(tmp_path: Path, monkeypatch) -> None:
    store = _store(tmp_path, capacity=1)
    keys = _fill(store, 2)
    monkeypatch.setattr(time, "time", lambda: 1_000_000.0)
    store.pin("now", [keys[0]], ttl=0)  # expires at this very instant: still held
    assert store.evict() == 1
    assert store.contains(keys[0]) and not store.contains(keys[1])


def test_usage_counts_whole_blocks_only(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.usage() == (0, 0)
    store.put(bytes(32), parent=bytes(32), tokens=[1], kv=_kv(1.0, 4096))
    store.put(bytes([1]) * 32, parent=bytes(32), tokens=[2], kv=_kv(2.0, 1024))
    sizes = [p.stat().st_size for p in store.blocks.iterdir()]
    (store.blocks / f".{'ab' * 32}.123.tmp").write_bytes(bytes(10_000))  # a block being written
    assert store.usage() == (2, sum(sizes))


def test_blocks_being_written_are_neither_counted_nor_evicted(tmp_path: Path) -> None:
    one = _one_block_bytes(tmp_path)
    store = _store(tmp_path, capacity=3 * one)
    keys = []
    for i in range(3):
        (store.blocks / f".w{i}.tmp").write_bytes(bytes(2 * one))
        keys += [bytes([i + 1]) * 32]
        store.put(keys[-1], parent=bytes(32), tokens=[i], kv=_kv(float(i)))
    (store.blocks / ".w3.tmp").write_bytes(bytes(2 * one))
    assert store.evict() == 0 and all(store.contains(k) for k in keys)
    small = KVStore(tmp_path, fmt="fmt", capacity_bytes=one, role="small")  # another process's limit
    assert small.evict() == 2
    assert small.usage() == (1, one)
    assert len(list(store.blocks.glob(".w*.tmp"))) == 4


def test_evict_reports_what_it_removed(tmp_path: Path, caplog) -> None:
    one = _one_block_bytes(tmp_path)
    store = _store(tmp_path, capacity=2 * one)
    keys = _fill(store, 5)
    with caplog.at_level("WARNING", logger="agentshare.vllm.store"):
        assert store.evict() == 3
    assert [store.contains(k) for k in keys] == [False, False, False, True, True]
    assert (store.counters.evicted_blocks, store.counters.evicted_bytes) == (3, 3 * one)
    assert store.usage() == (2, 2 * one)  # exactly at capacity: not over it
    assert not [r for r in caplog.records if "over capacity" in r.getMessage()]


def test_a_store_at_exactly_its_capacity_is_left_alone(tmp_path: Path) -> None:
    """Within capacity evict does no work: no block goes and the pins are not even read."""
    one = _one_block_bytes(tmp_path)
    store = _store(tmp_path, capacity=2 * one)
    keys = _fill(store, 2)
    store.pin("old", [], ttl=-1)
    assert store.evict() == 0
    assert all(store.contains(k) for k in keys) and (store.pins / "old").exists()
    assert store.counters.evicted_blocks == 0


def test_a_store_over_capacity_only_by_pinned_blocks_says_so(tmp_path: Path, caplog) -> None:
    one = _one_block_bytes(tmp_path)
    store = _store(tmp_path, capacity=one)
    keys = _fill(store, 3)
    store.pin("all", keys[:2], ttl=60)
    with caplog.at_level("WARNING", logger="agentshare.vllm.store"):
        assert store.evict() == 1
    assert [r for r in caplog.records if "over capacity" in r.getMessage()]
    assert store.usage() == (2, 2 * one)


def _evicted_elsewhere(monkeypatch, store: KVStore, *, after_stat: bool) -> None:
    """Another process removes the oldest block while this one scans the blocks (once)."""
    scandir = os.scandir
    done = []

    def racing(path):
        entries = list(scandir(path))
        if Path(path) == store.blocks and not done:
            done.append(1)
            if after_stat:
                for e in entries:
                    e.stat()  # scandir's entries keep their stat
            oldest = min(entries, key=lambda e: os.stat(e.path).st_mtime)
            os.unlink(oldest.path)
        return iter(entries)

    monkeypatch.setattr(os, "scandir", racing)


def test_a_block_evicted_by_another_process_during_a_scan_is_skipped(tmp_path: Path, monkeypatch) -> None:
    one = _one_block_bytes(tmp_path)
    store = _store(tmp_path, capacity=2 * one)
    keys = _fill(store, 4)
    _evicted_elsewhere(monkeypatch, store, after_stat=False)
    assert store.usage() == (3, 3 * one)
    monkeypatch.undo()
    store = _store(tmp_path / "again", capacity=2 * one)
    keys = _fill(store, 4)
    _evicted_elsewhere(monkeypatch, store, after_stat=False)
    assert store.evict() == 1  # three were left: one more to go
    assert [store.contains(k) for k in keys] == [False, False, True, True]
    assert store.counters.evicted_blocks == 1


def test_a_block_another_process_evicts_first_is_not_counted_as_ours(tmp_path: Path, monkeypatch) -> None:
    one = _one_block_bytes(tmp_path)
    store = _store(tmp_path, capacity=2 * one)
    keys = _fill(store, 4)
    _evicted_elsewhere(monkeypatch, store, after_stat=True)
    removed = store.evict()
    assert removed >= 1 and (store.counters.evicted_blocks, store.counters.evicted_bytes) == (removed, removed * one)
    assert store.usage() == (3 - removed, (3 - removed) * one) and store.contains(keys[-1])


def test_an_expired_pin_another_process_removed_first_is_no_error(tmp_path: Path, monkeypatch) -> None:
    store = _store(tmp_path, capacity=1)
    keys = _fill(store, 2)
    store.pin("old", [keys[0]], ttl=-1)
    unlink = Path.unlink

    def raced(self, missing_ok=False):
        if self.parent == store.pins:
            os.unlink(self)  # the other process's sweep
        return unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", raced)
    assert store.evict() == 2
    assert not (store.pins / "old").exists()


def test_counters_total_reads_published_counters_only(tmp_path: Path) -> None:
    """Counters being written (temporary names) and unreadable files are skipped, wherever they are."""
    stores = [_store(tmp_path, role=f"r{i}") for i in range(5)]
    stats = stores[0].stats_dir
    for i, s in enumerate(stores):
        (stats / f".r{i}-1.json.tmp").write_text(json.dumps({"saved_blocks": 1000}))
        s.put(bytes([i]) * 32, parent=bytes(32), tokens=[i], kv=_kv(1.0))
        s.publish()
        (stats / f"bad{i}.json").write_text("{not json" if i % 2 else json.dumps({"no_such_counter": 1}))
    total = stores[0].counters_total()
    assert (total.saved_blocks, total.saved_bytes) == (5, 5 * _kv(1.0).nbytes)


def test_open_store_finds_the_one_format_the_instances_wrote(tmp_path: Path) -> None:
    writer = KVStore(tmp_path, fmt="fa", capacity_bytes=1 << 20, role="vllm")
    writer.describe({"block_size": 16, "family": FAMILY})
    writer.describe({"block_size": 32, "family": FAMILY})  # described again: the last one holds
    writer.put(bytes(32), parent=bytes(32), tokens=[1], kv=_kv(1.0))
    (tmp_path / "stray-file").write_text("not a format")
    store, facts = open_store(tmp_path, capacity_bytes=12345, role="frontend")
    assert facts == {"block_size": 32, "family": FAMILY}
    assert (store.fmt, store.capacity_bytes) == ("fa", 12345)
    assert store.get(bytes(32), parent=bytes(32), tokens=[1]) is not None
    store.publish()
    assert (tmp_path / "fa" / "stats" / f"frontend-{os.getpid()}.json").exists()
    assert sorted(p.name for p in (tmp_path / "fa").iterdir()) == ["blocks", "config.json", "pins", "stats"]


def test_open_store_refuses_no_format_or_several(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"found \[\]"):
        open_store(tmp_path / "missing", capacity_bytes=1, role="t")
    with pytest.raises(RuntimeError, match=r"found \[\]"):
        open_store(tmp_path, capacity_bytes=1, role="t")
    for fmt in ("fb", "fa"):
        KVStore(tmp_path, fmt=fmt, capacity_bytes=1, role="t").describe({"fmt": fmt})
    with pytest.raises(RuntimeError, match=r"found \['fa', 'fb'\]"):
        open_store(tmp_path, capacity_bytes=1, role="t")


@pytest.mark.parametrize("body", ["[]", '{"expires": "soon", "keys": []}', '{"expires": 1e30, "keys": 7}', "null"])
def test_a_pin_file_that_is_not_a_pin_stops_no_eviction(tmp_path: Path, body: str) -> None:
    """A pin file of another shape (corrupt, or another writer's) protects nothing and raises nothing."""
    store = _store(tmp_path, capacity=2 * _one_block_bytes(tmp_path / "probe"))
    keys = _fill(store, 3)
    store.pin("live", keys[:1], ttl=60)
    (store.pins / "odd").write_text(body)
    assert store.evict() == 1
    assert store.contains(keys[0]) and not store.contains(keys[1])  # the live pin still holds


def test_a_stats_file_with_a_bad_field_is_skipped_whole(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.counters.saved_blocks = 2
    store.publish()
    (store.stats_dir / "other-1.json").write_text(json.dumps({"saved_blocks": 5, "loaded_blocks": "many"}))
    total = store.counters_total()
    assert (total.saved_blocks, total.loaded_blocks) == (2, 0)


def test_an_expired_pin_without_keys_is_swept_too(tmp_path: Path) -> None:
    store = _store(tmp_path, capacity=_one_block_bytes(tmp_path / "probe"))
    _fill(store, 2)
    (store.pins / "bare").write_text(json.dumps({"expires": time.time() - 1}))
    assert store.evict() == 1
    assert not (store.pins / "bare").exists()


def _ranked(tmp_path: Path, capacity: int = 1 << 20, role: str = "t") -> KVStore:
    return KVStore(tmp_path, fmt="fmt", capacity_bytes=capacity, role=role, parts=2)


def test_a_tensor_parallel_block_is_held_only_when_every_ranks_part_is(tmp_path: Path) -> None:
    """Each rank writes and reads its own share of a block; a block with a rank's part missing is
    not held (the frontend would pin and claim a prefix one rank cannot load)."""
    rank0, rank1 = _ranked(tmp_path, role="rank0"), _ranked(tmp_path, role="rank1")
    b = prefix_blocks(list(range(20)), family=FAMILY, salt="", block_size=16)[0]
    tokens = list(range(16))
    assert rank0.put(b.key, parent=b.parent, tokens=tokens, kv=_kv(0.0), part=0)
    assert not rank1.contains(b.key) and rank1.held_prefix([b.key]) == 0
    assert rank1.put(b.key, parent=b.parent, tokens=tokens, kv=_kv(1.0), part=1)
    assert rank0.contains(b.key) and rank0.held_prefix([b.key]) == 1
    for part in (0, 1):  # each rank gets its own heads back, never the other's
        got = rank0.get(b.key, parent=b.parent, tokens=tokens, part=part)
        assert got is not None and (got.view(np.float32) == float(part)).all()
    assert sorted(p.name for p in rank0.blocks.iterdir()) == [f"{b.key.hex()}.0", f"{b.key.hex()}.1"]
    assert rank0.usage() == (1, 2 * (rank0.blocks / f"{b.key.hex()}.0").stat().st_size)
    with pytest.raises(ValueError, match="part 2 of a store of 2"):
        rank0.get(b.key, parent=b.parent, tokens=tokens, part=2)
    with pytest.raises(ValueError, match="part -1"):
        rank0.put(b.key, parent=b.parent, tokens=tokens, kv=_kv(0.0), part=-1)
    with pytest.raises(ValueError, match="at least 1"):
        KVStore(tmp_path, fmt="fmt", capacity_bytes=1, role="t", parts=0)


def test_a_part_file_renamed_to_another_rank_is_a_miss(tmp_path: Path) -> None:
    store = _ranked(tmp_path)
    key = bytes(range(32))
    store.put(key, parent=bytes(32), tokens=[1], kv=_kv(1.0), part=0)
    os.rename(store.blocks / f"{key.hex()}.0", store.blocks / f"{key.hex()}.1")
    assert store.get(key, parent=bytes(32), tokens=[1], part=1) is None
    assert store.counters.rejected_blocks == 1


def test_eviction_removes_a_blocks_parts_together_and_spares_pinned_ones(tmp_path: Path) -> None:
    one = len(_kv(0.0).tobytes())
    store = _ranked(tmp_path, capacity=1 << 30)
    keys = [bytes([i]) * 32 for i in range(3)]
    for i, key in enumerate(keys):
        for part in (0, 1):
            store.put(key, parent=bytes(32), tokens=[i], kv=_kv(float(i)), part=part)
            t = 1_000 + 10 * i + part  # parts of one block written at nearly the same time
            os.utime(store.blocks / f"{key.hex()}.{part}", (t, t))
    _, held = store.usage()
    store.pin("p", [keys[0]], ttl=60)
    store.capacity_bytes = held - one  # one part too many: a whole block goes, the oldest unpinned
    assert store.evict() == 1
    assert [store.contains(k) for k in keys] == [True, False, True]
    assert not any(p.name.startswith(keys[1].hex()) for p in store.blocks.iterdir())
    assert store.counters.evicted_blocks == 1 and store.counters.evicted_bytes == held // 3
    assert store.usage() == (2, 2 * held // 3)


def test_open_store_opens_as_many_parts_as_the_instances_wrote(tmp_path: Path) -> None:
    writer = _ranked(tmp_path)
    writer.describe({"block_size": 16, "family": FAMILY, "parts": 2})
    store, _ = open_store(tmp_path, capacity_bytes=1 << 20, role="frontend")
    assert store.parts == 2
