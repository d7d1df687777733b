import pytest
import torch

from server.kv.errors import KVAllocationError
from server.kv.storage import KVSpec, KVStorage

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


def test_budget_sizes_the_pool_and_dtype_sizes_the_block():
    per_block = 2 * 3 * 2 * 64 * 2 * 16  # K+V, layers, heads, dim, bf16 bytes, tokens
    assert SPEC.bytes_per_block(16) == per_block
    store = KVStorage.from_budget(SPEC, budget_bytes=10 * per_block + 1, block_size=16)
    assert store.num_blocks == 10 and store.total_bytes == 10 * per_block
    assert store.k[0].shape == (2, 160, 64) and store.k[0].dtype == torch.bfloat16
    assert len(store.k) == len(store.v) == 3


def test_block_views_are_in_place_and_slots_address_blocks():
    store = KVStorage(SPEC, num_blocks=4, block_size=16)
    k, _v = store.block_view(1, first_block=2, num_blocks=2)
    k.fill_(1.0)
    assert k.data_ptr() == store.k[1][:, 32:].data_ptr()
    assert store.k[1][:, 32:].eq(1).all() and store.k[1][:, :32].eq(0).all()
    assert store.slots([3, 0]).tolist() == list(range(48, 64)) + list(range(16))
    with pytest.raises(IndexError):
        store.block_view(0, first_block=3, num_blocks=2)


def test_budget_below_one_block_is_a_typed_error():
    with pytest.raises(KVAllocationError, match="holds no block"):
        KVStorage.from_budget(SPEC, budget_bytes=100, block_size=16)


def test_an_impossible_allocation_is_a_typed_error_not_a_torch_exception():
    with pytest.raises(KVAllocationError, match="lower the KV pool size"):
        KVStorage(SPEC, num_blocks=2**40, block_size=16)
