"""The vllm engine's prefix KV store (no vLLM needed): keys, checks, pins, eviction, counters."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from server.kv.keys import Layout, Namespace
from server.vllm.store import KVStore, prefix_blocks

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
