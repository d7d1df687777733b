"""Decode modules on disk: identified, and sorted into shared or private (the engine's kinds,
``server/engine/kinds``, then load their weights).

A module directory holds its weights and, if it was trained for sharing, a manifest::

    coder/
      agentshare-module.json        kind, family digest, invocation placement (manifest.py)
      adapter_config.json           } kind "lora": a peft-format adapter (r, lora_alpha,
      adapter_model.safetensors     }   target_modules); read directly, no peft at serving time
      config.json + *.safetensors     kind "full": a fine-tuned copy of the base

Who computes what (docs/design.md §2):

==========================================  ===============================================
module                                      positions < IP            positions >= IP
==========================================  ===============================================
the base                                    base (shared)             base
manifest naming the serving family          base (shared)             the module
  ... with ``recompute_layers: k``          base below layer L-k,     the module
                                            the module above (its own
                                            KV, from the base's state)
no manifest, or another family              the module (private prefill, IP = 0)
==========================================  ===============================================

"Another family" is the served base at another KV dtype, for a LoRA module: its updates apply to
the base's own weights, only the KV differs. A LoRA whose manifest names a family that is the
served base at no KV dtype was trained on other weights (or another tokenizer or config); its
updates would land on weights they were not trained for, so it is refused, not served.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.kv.family import weights_digest
from server.modules.manifest import MANIFEST_FILE, Manifest, ManifestError, ModuleKind
from server.prompt import Placement


class ModuleLoadError(ValueError):
    """A module directory that cannot be served; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class Identified:
    """What a module directory is, before any weight is read."""

    kind: str
    digest: str  # identity of the module's weights + manifest: its KV namespace owner
    shares_prefill: bool
    placement: Placement
    reason: str
    recompute_layers: int = 0  # top layers it recomputes over the shared prefix (0: none)
    fidelity: dict[str, Any] | None = field(default=None, compare=False)
    """What sharing costs it, as ``finetune --fidelity`` measured (its manifest); None when it
    was not measured or the module does not share."""


def identify(
    path: Path | str, *, name: str, family: str, base_families: Collection[str] | None = None,
) -> Identified:
    """Read the module in ``path``: its kind, identity, and whether it joins ``family``.

    ``base_families``: the served base's family at every KV dtype
    (:func:`server.kv.family.base_families`); a LoRA module whose manifest names none of them
    was trained on another base and is refused (:class:`ModuleLoadError`). None: not checked,
    for callers that only describe a module the server already loaded.
    """
    d = Path(path)
    if not d.is_dir():
        raise ModuleLoadError(f"module {name!r}: {d} is not a directory")
    try:
        manifest = Manifest.read(d)
    except ManifestError as exc:  # unreadable manifest: refuse loudly rather than guess
        raise ModuleLoadError(f"module {name!r}: {exc}") from exc
    kind = manifest.kind if manifest else _guess_kind(d)
    if kind is None:
        raise ModuleLoadError(
            f"module {name!r}: {d} holds neither a peft adapter (adapter_model.safetensors) "
            f"nor a model (config.json + *.safetensors), and no {MANIFEST_FILE}"
        )
    if manifest is not None and kind is ModuleKind.LORA and base_families is not None:
        _check_base(name, manifest, family, base_families)
    shards = sorted(d.glob("adapter_model.safetensors" if kind is ModuleKind.LORA else "*.safetensors"))
    try:
        digest = _module_digest(d, manifest, shards)
    except (ValueError, KeyError, OSError) as exc:  # a truncated or foreign weights file
        raise ModuleLoadError(f"module {name!r}: its weights cannot be read ({exc}); re-export the module") from exc
    if manifest is None:
        shares, reason = False, f"no {MANIFEST_FILE}: private prefill"
    elif manifest.family != family:
        other_dtype = base_families is not None and manifest.family in base_families
        why = "this base at another KV dtype than" if other_dtype else "not"
        shares, reason = False, f"manifest names family {manifest.family[:12]}…, {why} the server's {family[:12]}…: private prefill"
    else:
        shares, reason = True, f"joins family {family[:12]}…"
    placement = manifest.invocation if manifest else Placement.TURN
    recompute = manifest.recompute_layers if manifest and shares else 0  # a private prefill computes all
    if recompute and kind is not ModuleKind.LORA:
        raise ModuleLoadError(f"module {name!r}: recompute_layers is served for lora modules only, "
                              f"this one is {kind.value!r}; drop recompute_layers from its manifest")
    if recompute:
        reason += f", recomputes its top {recompute} layers over the prefix"
    fidelity = manifest.fidelity if manifest and shares else None
    return Identified(str(kind), digest, shares, placement, reason, recompute, fidelity)


def _check_base(name: str, manifest: Manifest, family: str, base_families: Collection[str]) -> None:
    if manifest.family == family or manifest.family in base_families:
        return
    config = manifest.training.get("config")
    trained = manifest.training.get("base") or (config.get("base") if isinstance(config, dict) else None)
    on = f" (trained on {trained})" if isinstance(trained, str) and trained else ""
    raise ModuleLoadError(
        f"module {name!r}: a LoRA adapter for another base model{on}: its manifest names family "
        f"{manifest.family[:12]}…, which is this server's base at no KV dtype, so its updates would "
        "land on weights they were not trained for; serve it with --model set to the base it was "
        "trained on (the shipped example modules: --model examples/modules/team-base)"
    )


def _guess_kind(d: Path) -> ModuleKind | None:
    if (d / "adapter_model.safetensors").exists():
        return ModuleKind.LORA
    if (d / "config.json").exists() and any(d.glob("*.safetensors")):
        return ModuleKind.FULL
    return None


def _module_digest(d: Path, manifest: Manifest | None, shards: list[Path]) -> str:
    h = hashlib.sha256(b"agentshare/module/v1\n")
    h.update((manifest.to_json() if manifest else "no-manifest").encode())
    for extra in ("adapter_config.json", "config.json"):
        if (d / extra).exists():
            h.update((d / extra).read_bytes())
    if shards:
        h.update(weights_digest(shards).encode())
    return h.hexdigest()
