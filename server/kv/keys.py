"""Block keys: the identity of a cached KV block.

A block's key is a digest chained over its parent's key, the namespace it was computed in and
its own token ids::

    key[i] = H(tag, key[i-1], namespace.digest, tokens[i*B:(i+1)*B])        key[-1] = ROOT

so two blocks share a key only when everything before them and everything that computed them
agree. ``H`` is sha256 by default: stable across processes and machines (never Python's
per-process ``hash()``), and collision-resistant. The pool still compares token ids on every hit,
so even an injected weak digest cannot serve wrong KV (see ``tests/server/kv``).

Namespaces (docs/design.md §2) say *who computed* a block:

==========  =========================================  ==========================================
kind        identity                                   served to
==========  =========================================  ==========================================
``family``  (family digest, cache salt)                every module of the family
``module``  (module digest, invocation point, salt)    that module only (its next turns)
``split``   (module digest, recompute layers, salt)    that module only: a layer-split module's
                                                       prefix (base KV below the split, its own
                                                       above), read again at every later turn
lossy       any of the above + codec (e.g. ``int8``)   never as exact; only to lossy readers
==========  =========================================  ==========================================

A module block records its invocation point (IP) too: positions of the block before the IP were
computed by the base and positions from it on by the module, so the same tokens under another IP
are different KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

Digest = Callable[[bytes], bytes]
"""A function from bytes to a fixed-size digest. Injected in tests to force collisions."""


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


ROOT_KEY = b"\x00" * 32
"""The parent key of the first block of every sequence."""

_KEY_TAG = b"agentshare/block/v1"
_NS_TAG = b"agentshare/namespace/v1"


class NamespaceKind(Enum):
    FAMILY = "family"
    MODULE = "module"
    SPLIT = "split"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Who computed a block, and for which tenant.

    Build one with :meth:`family` or :meth:`module`; derive the namespace of blocks that went
    through a lossy transfer with :meth:`lossy`.

    >>> fam = Namespace.family("f" * 64, salt="tenant-a")
    >>> fam.lossy("int8").is_exact
    False
    >>> fam.digest != Namespace.family("f" * 64, salt="tenant-b").digest
    True
    """

    kind: NamespaceKind
    owner: str
    """Family digest (``FAMILY``), module digest (``MODULE``), or module digest and split
    (``SPLIT``: ``<digest>/recompute-<k>``)."""
    salt: str = ""
    """Cache salt: one per tenant (API key). The empty string is the single default tenant."""
    invocation_point: int | None = None
    """Absolute token position of the IP; set for ``MODULE`` namespaces only."""
    codec: str | None = None
    """Lossy codec the blocks went through (``"int8"``), or None for exact blocks."""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.owner:
            raise ValueError("namespace owner (family or module digest) must be non-empty")
        if self.kind is NamespaceKind.MODULE:
            if self.invocation_point is None or self.invocation_point < 0:
                raise ValueError("a module namespace needs an invocation point >= 0")
        elif self.invocation_point is not None:
            raise ValueError(f"a {self.kind.value} namespace has no invocation point")
        parts = [
            _NS_TAG,
            self.kind.value.encode(),
            self.owner.encode(),
            self.salt.encode(),
            b"" if self.invocation_point is None else str(self.invocation_point).encode(),
            b"" if self.codec is None else self.codec.encode(),
        ]
        # Length-prefix every field so no two different tuples encode to the same bytes.
        encoded = b"".join(struct.pack("<I", len(p)) + p for p in parts)
        object.__setattr__(self, "digest", sha256(encoded))

    @classmethod
    def family(cls, family_digest: str, *, salt: str = "") -> Namespace:
        return cls(NamespaceKind.FAMILY, family_digest, salt)

    @classmethod
    def module(cls, module_digest: str, *, invocation_point: int, salt: str = "") -> Namespace:
        return cls(NamespaceKind.MODULE, module_digest, salt, invocation_point)

    @classmethod
    def split(cls, module_digest: str, *, recompute_layers: int, salt: str = "") -> Namespace:
        """The prefix blocks of a module that recomputes its top ``recompute_layers`` layers:
        every position in them is before the IP, so they do not depend on where the IP sits
        (a later turn, whose IP is further on, reads them again)."""
        if recompute_layers <= 0:
            raise ValueError(f"a split namespace recomputes at least one layer, got {recompute_layers}")
        return cls(NamespaceKind.SPLIT, f"{module_digest}/recompute-{recompute_layers}", salt)

    def lossy(self, codec: str) -> Namespace:
        """The namespace of this namespace's blocks after a lossy transfer through ``codec``."""
        if not codec:
            raise ValueError("codec must be non-empty")
        return Namespace(self.kind, self.owner, self.salt, self.invocation_point, codec)

    @property
    def is_exact(self) -> bool:
        return self.codec is None


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Canonical encoding of token ids: little-endian uint32 (ids are vocabulary indices)."""
    return np.asarray(tokens, dtype="<u4").tobytes()


def chain_key(
    parent: bytes, namespace: Namespace, tokens: Sequence[int], digest: Digest = sha256
) -> bytes:
    """The key of one block, chained over its parent's key."""
    return _chain(parent, namespace, token_bytes(tokens), digest)


def _chain(parent: bytes, namespace: Namespace, block_bytes: bytes, digest: Digest) -> bytes:
    return digest(_KEY_TAG + parent + namespace.digest + block_bytes)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a token sequence's invocation point splits it, and who owns each side.

    Block ``i`` covers tokens ``[i*B, (i+1)*B)``. It belongs to the family namespace when it
    ends at or before the IP (every position in it is < IP, computed by the base), and to the
    module namespace otherwise. A block that straddles the IP holds module-computed positions,
    so it is the module's. With ``module=None`` (the base module, whose IP does not matter) every
    block is the family's.

    >>> lay = Layout(Namespace.family("f" * 64), Namespace.module("m" * 64, invocation_point=40))
    >>> " ".join(lay.namespace_of(i, block_size=16).kind.value for i in range(4))
    'family family module module'
    """

    family: Namespace
    module: Namespace | None = None
    prefix: Namespace | None = None
    """A ``SPLIT`` namespace for the blocks before the IP (None: they are the family's)."""

    def __post_init__(self) -> None:
        if self.family.kind is not NamespaceKind.FAMILY:
            raise ValueError("Layout.family must be a family namespace")
        if self.prefix is not None and (self.prefix.kind is not NamespaceKind.SPLIT or self.module is None
                                        or self.prefix.salt != self.family.salt):
            raise ValueError("Layout.prefix must be a split namespace of the module's tenant")
        if self.module is not None:
            if self.module.kind is not NamespaceKind.MODULE:
                raise ValueError("Layout.module must be a module namespace")
            if self.module.salt != self.family.salt:
                raise ValueError("family and module namespaces of one request must share a salt")

    @property
    def invocation_point(self) -> int | None:
        return None if self.module is None else self.module.invocation_point

    def namespace_of(self, block_index: int, *, block_size: int) -> Namespace:
        ip = self.invocation_point
        if ip is None:
            return self.family
        if (block_index + 1) * block_size <= ip:
            return self.prefix or self.family
        return self.module  # type: ignore[return-value]  # ip is not None => module is set

    def block_keys(
        self, tokens: Sequence[int], *, block_size: int, digest: Digest = sha256
    ) -> list[bytes]:
        """Keys of the full blocks of ``tokens`` (a trailing partial block has no key)."""
        data = token_bytes(tokens)  # encode once, slice per block
        width = 4 * block_size
        keys: list[bytes] = []
        parent = ROOT_KEY
        for i in range(len(tokens) // block_size):
            ns = self.namespace_of(i, block_size=block_size)
            parent = _chain(parent, ns, data[i * width : (i + 1) * width], digest)
            keys.append(parent)
        return keys
