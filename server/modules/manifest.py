"""The manifest of a decode module: what it is, which prefill family it joins, where its IP sits.

Written by the fine-tuning tool next to the module's weights as ``agentshare-module.json``::

    {"format": 1, "name": "coder", "kind": "lora", "family": "<64 hex>", "invocation": "turn",
     "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}, "training": {...}}

A module joins a family's shared prefill *only* through a manifest naming that family's digest
(docs/design.md §2). A directory without a manifest, or with one naming another family, is still served
— with a private prefill under its own key, never mixed — except a LoRA whose manifest names
another base (``server/modules/registry.py``).

>>> m = Manifest(name="coder", kind=ModuleKind.LORA, family="ab" * 32,
...              lora=LoraSpec(rank=8, alpha=16, target_modules=("q_proj",)))
>>> Manifest.from_json(m.to_json()) == m
True
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from server.prompt import Placement

MANIFEST_FILE = "agentshare-module.json"
FORMAT = 1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ModuleKind(StrEnum):
    BASE = "base"  # the base model itself
    LORA = "lora"  # low-rank adapters on the base weights
    FULL = "full"  # a fully fine-tuned copy of the base


class ManifestError(ValueError):
    """A manifest that cannot be read; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class LoraSpec:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    kind: ModuleKind
    family: str
    invocation: Placement = Placement.TURN
    lora: LoraSpec | None = None
    training: dict[str, Any] = field(default_factory=dict, compare=False)
    recompute_layers: int = 0
    """Top layers whose prefix KV the module recomputes from the base's hidden state below them
    (trained with ``finetune --recompute``; 0: it reads the base's KV of every layer)."""
    fidelity: dict[str, Any] | None = field(default=None, compare=False)
    """What sharing costs the module, measured by ``finetune --fidelity``: its held-out score on
    the shared prefill and on its own (``shared``, ``own``, ``gap_points``, ``ci_points``), the
    split it chose, the rows (``server/training/fidelity.py``); None: not measured."""

    def __post_init__(self) -> None:
        if not self.name or not re.fullmatch(r"[A-Za-z0-9._-]+", self.name):
            raise ManifestError(f"name must be letters, digits, '.', '_' or '-'; got {self.name!r}")
        if not _HEX64.match(self.family):
            raise ManifestError(f"family must be a 64-hex-digit digest, got {self.family!r}")
        if (self.kind is ModuleKind.LORA) != (self.lora is not None):
            raise ManifestError("a 'lora' module needs a 'lora' section, and only a lora module has one")
        if self.lora is not None and (self.lora.rank <= 0 or not self.lora.target_modules):
            raise ManifestError("lora.rank must be positive and lora.target_modules non-empty")
        if not isinstance(self.recompute_layers, int) or self.recompute_layers < 0:
            raise ManifestError(f"recompute_layers must be a whole number >= 0, got {self.recompute_layers!r}")

    def to_json(self) -> str:
        d = asdict(self)
        d = {"format": FORMAT, **d, "kind": self.kind.value, "invocation": self.invocation.value}
        if not self.recompute_layers:
            d.pop("recompute_layers")  # 0: a manifest as before the field existed (same digest)
        if self.fidelity is None:
            d.pop("fidelity")  # not measured: a manifest as before the field existed
        if self.lora is None:
            d.pop("lora")
        else:
            d["lora"]["target_modules"] = list(self.lora.target_modules)
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "manifest") -> Manifest:
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise ManifestError(f"{source}: not valid JSON ({exc})") from exc
        if not isinstance(d, dict):
            raise ManifestError(f"{source}: expected a JSON object")
        if d.get("format") != FORMAT:
            raise ManifestError(f"{source}: unsupported format {d.get('format')!r} (expected {FORMAT})")
        try:
            lora = d.get("lora")
            return cls(
                name=d["name"],
                kind=ModuleKind(d["kind"]),
                family=d["family"],
                invocation=Placement(d.get("invocation", Placement.TURN.value)),
                lora=None if lora is None else LoraSpec(
                    int(lora["rank"]), float(lora["alpha"]), tuple(lora["target_modules"])
                ),
                training=dict(d.get("training", {})),
                recompute_layers=_whole(d.get("recompute_layers", 0), "recompute_layers"),
                fidelity=_fidelity(d.get("fidelity")),
            )
        except KeyError as exc:
            raise ManifestError(f"{source}: missing field {exc.args[0]!r}") from exc
        except (ValueError, TypeError) as exc:
            raise ManifestError(f"{source}: {exc}") from exc

    def write(self, module_dir: Path | str) -> Path:
        path = Path(module_dir) / MANIFEST_FILE
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, module_dir: Path | str) -> Manifest | None:
        """The directory's manifest, or None if it has none. Raises ManifestError if unreadable."""
        path = Path(module_dir) / MANIFEST_FILE
        if not path.exists():
            return None
        return cls.from_json(path.read_text(), source=str(path))


def _whole(value: Any, field_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field_name} must be a whole number, got {value!r}")
    return value


def _fidelity(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"fidelity must be an object of measured figures, got {value!r}")
    return value
