"""KV memory of the server: block keys, the block pool, storage and family identity.

The pieces, one noun per module::

    keys.py     Namespace, Layout, chained block keys (sha256)
    pool.py     BlockPool: refcounts, LRU eviction, pins with TTL, in-flight waits, counters
    storage.py  KVSpec, KVStorage: the per-layer K/V tensors the pool's blocks index into
    family.py   family_digest(): the content identity that decides who may share KV
    trace.py    the Mooncake trace and its replay through a pool (no model)
    errors.py   the KV error tree
"""

from server.kv.errors import (
    BlockAborted,
    KVAllocationError,
    KVError,
    PoolExhausted,
    PoolInvariantError,
)
from server.kv.keys import ROOT_KEY, Layout, Namespace, NamespaceKind, chain_key, sha256
from server.kv.pool import Block, BlockPool, BlockState, Pin, PoolStats, PrefixMatch, Usage

__all__ = [
    "ROOT_KEY",
    "Block",
    "BlockAborted",
    "BlockPool",
    "BlockState",
    "KVAllocationError",
    "KVError",
    "Layout",
    "Namespace",
    "NamespaceKind",
    "Pin",
    "PoolExhausted",
    "PoolInvariantError",
    "PoolStats",
    "PrefixMatch",
    "Usage",
    "chain_key",
    "sha256",
]
