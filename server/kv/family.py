"""Prefill family: the content identity that decides who may share KV (docs/design.md §2).

Two models are in one family only if the base model would compute bit-identical KV for them:
same weights, same tokenizer and chat template, same attention/RoPE configuration, same KV
layout and dtype. The family is a digest of those contents, never a name::

    family = sha256( weights  (every tensor: name, dtype, shape, bytes; shard-independent)
                   | tokenizer (tokenizer files, chat template included)
                   | config    (config.json minus cosmetic keys: RoPE, windows, heads, ...)
                   | kv layout | kv dtype )

Hashing the weights reads them once (~1 s per GiB); the result is cached per weights file,
keyed by (path, size, mtime), in ``$AGENTSHARE_CACHE_DIR/digests.json``.

>>> import json, tempfile, pathlib, torch
>>> from safetensors.torch import save_file
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> save_file({"w": torch.ones(2, 2)}, d / "model.safetensors")
>>> _ = (d / "config.json").write_text(json.dumps({"rope_theta": 10000.0}))
>>> _ = (d / "tokenizer.json").write_text("{}")
>>> fam = family_digest(d, kv_dtype="float32", cache_dir=d / "cache")
>>> len(fam), fam == family_digest(d, kv_dtype="bfloat16", cache_dir=d / "cache")
(64, False)
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from server import paths

KV_LAYOUT = "agentshare-paged-v1:[kv_heads,slots,head_dim]"
"""Name of the KV layout the torch engine writes; part of every family digest."""

KV_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a KV pool holds: a module's manifest names its base's family at one of them."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)

COSMETIC_CONFIG_KEYS = frozenset(
    {"_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype", "use_cache"}
)
"""config.json keys that do not change the KV a model computes (weights' dtype is hashed with
the weights themselves)."""


@dataclass(frozen=True, slots=True)
class FamilyParts:
    """The component digests of a family, for explaining why two models are not one family."""

    weights: str
    tokenizer: str
    config: str
    kv_layout: str
    kv_dtype: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(
            "\n".join(("agentshare/family/v1", self.weights, self.tokenizer, self.config,
                       self.kv_layout, self.kv_dtype)).encode()
        ).hexdigest()

    def at_every_kv_dtype(self) -> frozenset[str]:
        """The digest of these parts at each of :data:`KV_DTYPES` (see :func:`base_families`)."""
        return frozenset(replace(self, kv_dtype=d).digest for d in KV_DTYPES)

    def differences(self, other: FamilyParts) -> list[str]:
        """Names of the parts that differ, e.g. ``['tokenizer']``."""
        return [f for f in self.__slots__ if getattr(self, f) != getattr(other, f)]


def family_digest(
    model_dir: str | Path, *, kv_dtype: str, kv_layout: str = KV_LAYOUT,
    cache_dir: str | Path | None = None,
) -> str:
    """The family digest (64 hex chars) of the model in ``model_dir`` served with ``kv_dtype``."""
    return family_parts(model_dir, kv_dtype=kv_dtype, kv_layout=kv_layout, cache_dir=cache_dir).digest


def base_families(
    model_dir: str | Path, *, kv_layout: str = KV_LAYOUT, cache_dir: str | Path | None = None,
) -> frozenset[str]:
    """The family of the model in ``model_dir`` at every KV dtype (:data:`KV_DTYPES`): the
    manifest of a LoRA module trained on these weights, tokenizer and config names one of them,
    whatever dtype its KV was trained in.

    >>> import json, tempfile, pathlib, torch
    >>> from safetensors.torch import save_file
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> save_file({"w": torch.ones(2)}, d / "model.safetensors")
    >>> _ = (d / "config.json").write_text("{}"); _ = (d / "tokenizer.json").write_text("{}")
    >>> fams = base_families(d, cache_dir=d / "cache")
    >>> len(fams), family_digest(d, kv_dtype="bfloat16", cache_dir=d / "cache") in fams
    (3, True)
    """
    return family_parts(model_dir, kv_dtype=KV_DTYPES[0], kv_layout=kv_layout, cache_dir=cache_dir).at_every_kv_dtype()


def family_parts(
    model_dir: str | Path, *, kv_dtype: str, kv_layout: str = KV_LAYOUT,
    cache_dir: str | Path | None = None,
) -> FamilyParts:
    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {d} does not exist")
    shards = sorted(d.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(
            f"no *.safetensors weights in {d}; convert the model to safetensors first"
        )
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {d}")
    tok_files = [d / n for n in TOKENIZER_FILES if (d / n).exists()]
    if not tok_files:
        raise FileNotFoundError(f"no tokenizer files in {d} (looked for {', '.join(TOKENIZER_FILES)})")
    cache = _DigestCache(Path(cache_dir) if cache_dir is not None else paths.cache_dir())
    return FamilyParts(
        weights=weights_digest(shards, cache),
        tokenizer=_files_digest(tok_files),
        config=config_digest(json.loads((d / "config.json").read_text())),
        kv_layout=kv_layout,
        kv_dtype=kv_dtype,
    )


def config_digest(config: dict[str, Any]) -> str:
    kept = {k: v for k, v in config.items() if k not in COSMETIC_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _files_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        data = p.read_bytes()
        h.update(struct.pack("<Q", len(p.name)) + p.name.encode() + struct.pack("<Q", len(data)) + data)
    return h.hexdigest()


def weights_digest(shards: list[Path], cache: _DigestCache | None = None) -> str:
    """Digest of every tensor in ``shards`` by name: the same tensors split differently agree."""
    per_tensor: dict[str, str] = {}
    for shard in shards:
        found = cache.get(shard) if cache else None
        if found is None:
            found = _shard_tensor_digests(shard)
            if cache:
                cache.put(shard, found)
        for name, dg in found.items():
            if name in per_tensor:
                raise ValueError(f"tensor {name!r} appears in more than one shard ({shard})")
            per_tensor[name] = dg
    h = hashlib.sha256()
    for name in sorted(per_tensor):
        h.update(f"{name}\0{per_tensor[name]}\n".encode())
    return h.hexdigest()


def _shard_tensor_digests(path: Path) -> dict[str, str]:
    """sha256 of (dtype, shape, bytes) for each tensor, read from the safetensors file in place."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"{path} is not a safetensors file (bad header: {exc})") from exc
        header.pop("__metadata__", None)
        base = 8 + n
        out: dict[str, str] = {}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for name, info in header.items():
                begin, end = info["data_offsets"]
                h = hashlib.sha256(f"{info['dtype']}{info['shape']}".encode())
                h.update(memoryview(mm)[base + begin : base + end])
                out[name] = h.hexdigest()
        return out


class _DigestCache:
    """Per-file tensor digests on disk, valid while the file's (size, mtime) are unchanged."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "digests.json"

    def _load(self) -> dict[str, Any]:
        try:
            loaded: dict[str, Any] = json.loads(self.path.read_text())
            return loaded
        except (OSError, ValueError):
            return {}  # absent or corrupt: recompute

    @staticmethod
    def _stamp(file: Path) -> list[int]:
        st = file.stat()
        return [st.st_size, st.st_mtime_ns]

    def get(self, file: Path) -> dict[str, str] | None:
        entry = self._load().get(str(file.resolve()))
        if entry and entry.get("stamp") == self._stamp(file):
            tensors: dict[str, str] = entry["tensors"]
            return tensors
        return None

    def put(self, file: Path, tensors: dict[str, str]) -> None:
        data = self._load()
        data[str(file.resolve())] = {"stamp": self._stamp(file), "tensors": tensors}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)  # atomic: concurrent readers never see half a file
        except OSError:
            pass  # a read-only cache only costs a recomputation next time
