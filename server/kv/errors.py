"""Errors of the KV layer.

::

    KVError
     ├── KVAllocationError      storage could not be allocated (budget too small, out of memory)
     ├── PoolExhausted          not enough free or evictable blocks for an allocation
     ├── BlockAborted           an awaited in-flight block was abandoned by its producer
     └── PoolInvariantError     a caller broke the ownership protocol (double free, stale id)
"""

from __future__ import annotations


class KVError(Exception):
    """Base of every error raised by ``server.kv``."""


class KVAllocationError(KVError):
    """KV storage could not be allocated."""


class PoolExhausted(KVError):
    """An allocation needs more blocks than are free or evictable (held and pinned blocks stay)."""

    def __init__(self, requested: int, available: int, capacity: int) -> None:
        self.requested = requested
        self.available = available
        self.capacity = capacity
        super().__init__(
            f"KV pool exhausted: {requested} blocks requested, {available} free or evictable "
            f"of {capacity}; retry later, release contexts, or enlarge the pool"
        )


class BlockAborted(KVError):
    """The request computing an awaited block gave up; the waiter must compute it itself."""


class PoolInvariantError(KVError):
    """The pool's ownership protocol was violated by a caller (a bug, never user input)."""
