"""Who computes each position of a request, and under which block keys: the one rule.

Every part of the system that must agree on a request's split asks this module: the engine
(what it computes with the base, what with the module, which cached blocks it may read), the
router (which prefix a prefill worker computes for a decode worker), the simulator, and
fine-tuning (the boundary a module is trained with). See docs/design.md §2::

    prompt:  [ shared context ............ ] [ agent's turn ............. ]
                                              ^ invocation point (IP)
             positions < IP: the family's base  positions >= IP: the module
             blocks keyed in the family's        blocks keyed in the module's
             namespace (shared by all modules)   namespace (its own, with the IP)

The IP of a module:

- the base itself: ``len(prompt)`` (it computes everything, and every block is the family's);
- a module of the family (its manifest names the serving base): where its placement puts it
  (:meth:`Prompt.invocation_point`), never past the last prompt token;
- a module outside the family (no manifest, another base): 0, a private prefill.

A module of the family with ``recompute_layers = k`` (the layer split) keeps its IP, but its
positions before it are the base's only below layer ``L - k`` (:func:`split_layer`): from there
on they are its own, fed the base's hidden state, and its blocks before the IP live in a split
namespace of its own (``Namespace.split``), which later turns read again.

>>> from server.prompt import Placement, Prompt
>>> prompt = Prompt(tuple(range(40)), context_len=32, turn_start=32, header_start=38)
>>> coder = Facts("coder", "c" * 64, shares_prefill=True, placement=Placement.HEADER)
>>> [invocation_point(prompt, m) for m in (BASE, coder, Facts(digest="x" * 64))]
[40, 38, 0]
>>> shared_prefix_len(prompt, coder, block_size=16)  # full blocks before the IP
32
>>> lay = layout(coder, 38, family="f" * 64, salt="tenant-a")
>>> [lay.namespace_of(i, block_size=16).kind.value for i in range(3)]
['family', 'family', 'module']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from server.kv.keys import Layout, Namespace
from server.prompt import Placement, Prompt


class ModuleFacts(Protocol):
    """What the rule needs to know about a decode module (``DecodeModule`` and the router's
    agent cards both provide it)."""

    @property
    def name(self) -> str: ...

    @property
    def is_base(self) -> bool: ...

    @property
    def shares_prefill(self) -> bool:
        """Its manifest names the serving family: positions before its IP are the base's."""
        ...

    @property
    def placement(self) -> Placement | str: ...


class KeyedModule(ModuleFacts, Protocol):
    """A module whose blocks the rule keys: its facts and its identity."""

    @property
    def digest(self) -> str:
        """The owner of the module's KV namespace (its weights and manifest, hashed)."""
        ...

    @property
    def recompute_layers(self) -> int:
        """Top layers whose prefix KV it recomputes from the base's hidden state (0: none)."""
        ...


@dataclass(frozen=True, slots=True)
class Facts:
    """Plain module facts, for callers that have no loaded module (the simulator, tests)."""

    name: str = ""
    digest: str = ""
    """The module's identity: the owner of its KV namespace."""
    is_base: bool = False
    shares_prefill: bool = False
    placement: Placement | str = Placement.TURN
    recompute_layers: int = 0


BASE = Facts("base", is_base=True, shares_prefill=True)
"""The base model's facts (its digest is never read: it keys every block in the family)."""


def invocation_point(prompt: Prompt, module: ModuleFacts) -> int:
    """The first position ``module`` computes itself; every earlier one is the base's."""
    if module.is_base:
        return len(prompt.token_ids)
    if not module.shares_prefill:
        return 0  # private prefill: the module computes everything itself
    return prompt.invocation_point(Placement(module.placement))


def shared_prefix_len(prompt: Prompt, module: ModuleFacts, *, block_size: int) -> int:
    """Tokens of the full blocks the family computes for this request (what a prefill worker
    can compute for it, and what any module of the family can read): 0 for a private prefill."""
    return invocation_point(prompt, module) // block_size * block_size


def split_layer(module: KeyedModule, num_layers: int) -> int:
    """The first layer a module computes itself over positions before its IP: ``num_layers``
    when it reads the base's KV of every layer, ``num_layers - k`` when it recomputes its top
    ``k`` (the layer split): below it the positions are the base's (its KV and its hidden
    state), from it on the module's, fed the base's hidden state at that depth.

    >>> split_layer(Facts("m", "d" * 64, shares_prefill=True, recompute_layers=8), 30)
    22
    >>> split_layer(BASE, 30)
    30
    """
    k = module.recompute_layers if module.shares_prefill and not module.is_base else 0
    if not 0 <= k <= num_layers:
        raise ValueError(f"{module.name}: recompute_layers {k} is outside 0..{num_layers}")
    return num_layers - k


def layout(
    module: KeyedModule, ip: int, *, family: str, salt: str = "", prefix_codec: str | None = None,
    share_prefill: bool = True,
) -> Layout:
    """The block namespaces of a request whose module computes from ``ip`` on.

    With
    ``share_prefill=False`` (the baseline of the benchmarks: caches keyed by module, as other
    engines key them) the family namespace is the module's own (by name). ``prefix_codec`` names the lossy
    codec a shared prefix crossed on its way here: the family blocks then live in that codec's
    lossy namespace, never among the exact ones.
    """
    fam = family if share_prefill else f"{family}/{module.name}"
    family_ns = Namespace.family(fam, salt=salt)
    if prefix_codec is not None and ip > 0:
        family_ns = family_ns.lossy(prefix_codec)
    if module.is_base:
        return Layout(family_ns)
    split = None
    if module.recompute_layers and module.shares_prefill:  # its prefix blocks hold its own top layers
        split = Namespace.split(module.digest, recompute_layers=module.recompute_layers, salt=salt)
        if prefix_codec is not None:
            split = split.lossy(prefix_codec)
    return Layout(family_ns, Namespace.module(module.digest, invocation_point=ip, salt=salt), split)
