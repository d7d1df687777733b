"""agentshare's KV connector for vLLM: one base prefill, loaded by every decode module of the family.

vLLM keys its prefix cache by LoRA adapter (and serves one model per instance), so N agents of
one base pay N prefills of their common context. This connector (vLLM's ``KVConnectorBase_V1``,
loaded through ``kv_transfer_config.kv_connector_module_path``) moves the base's prefix KV to the
instances that serve the modules::

    frontend ── POST /v1/completions tokens[:IP], kv_transfer_params {op: save, n: IP, salt} ──▶ base
                                        base instance: computes [0, IP), saves its blocks ──▶ store
    frontend ── POST /v1/completions tokens, model=<module>, {op: load, n: IP, salt} ──▶ decode
        decode instance: get_num_new_matched_tokens reports [local hit, IP) as external cached
        tokens; start_load_kv copies them into the paged cache; the module computes from IP on

The rules are the torch engine's (docs/design.md §2): positions before the invocation point
(IP) hold the base's KV, positions from it on the module's; blocks are keyed by
:mod:`server.kv.keys` (family digest, tenant salt, token chain) in :class:`~server.vllm.store.KVStore`.
The connector refuses a module whose manifest does not name the family (it reports no external
tokens: a private prefill), and a salt is part of every key, so tenants never share blocks.

A load is claimed only as the frontend asked for it, after making sure the blocks are in the
store and pinned; a block that is then missing or damaged is reported as a failed load
(``get_block_ids_with_load_errors``): vLLM fails the request (``kv_load_failure_policy: fail``)
and the frontend serves it by a private prefill. The module never computes the prefix under the
shared cache salt.

vLLM accepts a match that is not block-aligned (its scheduler takes ``num_computed + external``
as is), so the load ends exactly at the IP: no boundary rule beyond the torch engine's. The
store's blocks are ``block_size`` tokens (16) plus the prefix's partial tail; vLLM's block size
must be a multiple of it.

The KV layout is read from what vLLM hands a connector, never assumed: per-layer views
``[blocks, kv heads, tokens per kernel block, channels]`` (vLLM's standardised view), whose
kernel block may be smaller than the scheduler's block (then a scheduler block spans several
kernel blocks). The bytes of one token's channels are copied as they are, so the store's
``format`` digest covers the backend's layout name, dtype and shapes.

Under tensor parallelism each rank's worker holds its share of the KV heads: it saves and loads
its own part of every store block (:class:`~server.vllm.store.KVStore` ``parts``), and the
scheduler counts a block as held only when every rank's part is.

Configuration (``kv_connector_extra_config``), written by :mod:`server.vllm.launch`:
``store`` (directory), ``capacity_bytes``, ``family`` (the base's digest), ``block_size``,
``served`` (the instance's served model name), ``modules`` (name → the family its manifest
names, or null).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from server.vllm.store import KVStore, StoreBlock, prefix_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("agentshare.vllm.connector")

PARAMS_KEY = "agentshare"
"""The key of agentshare's entry in a request's ``kv_transfer_params``."""


@dataclass(slots=True)
class Transfer:
    """One request's copy between the paged cache and the store, positions ``[start, end)``."""

    request_id: str
    block_ids: list[int]
    tokens: list[int]
    blocks: list[StoreBlock]


@dataclass(slots=True)
class AgentshareMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass(slots=True)
class _Plan:
    op: str
    n: int
    tokens: list[int]
    blocks: list[StoreBlock]
    block_ids: list[int] = field(default_factory=list)
    missing: bool = False  # a load whose blocks were not all in the store when it was scheduled


def request_params(request: Request) -> dict[str, Any] | None:
    """agentshare's entry in a request's ``kv_transfer_params`` (None when it has none)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    p = params.get(PARAMS_KEY)
    if p is None:
        return None
    if not isinstance(p, dict) or p.get("op") not in ("save", "load") or not isinstance(p.get("n"), int) \
            or p["n"] < 0 or not isinstance(p.get("salt", ""), str):
        raise ValueError(f"kv_transfer_params.{PARAMS_KEY} must be {{op: save|load, n: int >= 0, salt: str}}, got {p!r}")
    return p


def check_parallel(parallel: Any) -> int:
    """The store parts an instance of this parallel layout writes: one per tensor-parallel rank
    (each rank holds its KV heads of every block, and loads only its own). Pipeline parallelism
    is refused: a stage holds some layers, and the store's parts are ranks, not stages.

    >>> from types import SimpleNamespace as NS
    >>> check_parallel(NS(tensor_parallel_size=2, pipeline_parallel_size=1))
    2
    >>> check_parallel(NS(tensor_parallel_size=1, pipeline_parallel_size=2))
    Traceback (most recent call last):
    ...
    ValueError: agentshare connector: pipeline_parallel_size 2: the prefix store holds every layer of a block in each part; run each instance as one pipeline stage (tensor parallelism is supported)
    """
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    if pp > 1:
        raise ValueError(f"agentshare connector: pipeline_parallel_size {pp}: the prefix store holds every layer "
                         "of a block in each part; run each instance as one pipeline stage (tensor parallelism "
                         "is supported)")
    return tp


def kv_format(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, family: str) -> str:
    """A digest of what a store block's bytes mean on this instance (and the family they hold):
    the layout, one rank's shapes, the dtype, the block size and the tensor-parallel size."""
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    parts = [
        family, str(kv_cache_config.kv_cache_layout), str(len(group.layer_names)),
        str(getattr(spec, "num_kv_heads", "")), str(getattr(spec, "head_size", "")),
        str(getattr(spec, "head_size_v", "")), str(getattr(spec, "dtype", "")), str(vllm_config.cache_config.block_size),
    ]
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if tp > 1:  # one rank's heads per part; left out at 1 so that single-rank stores keep their format
        parts.append(f"tp{tp}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


class AgentshareConnector(KVConnectorBase_V1):
    """See the module docstring. One instance per role (scheduler, worker) per vLLM process."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.parts = check_parallel(vllm_config.parallel_config)
        self.part = 0  # this worker's tensor-parallel rank: known once the KV caches are registered
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        try:
            self.family: str = extra["family"]
            self.served: str = extra.get("served", "")
            self.modules: dict[str, str | None] = dict(extra.get("modules", {}))
            root, capacity = extra["store"], int(extra["capacity_bytes"])
        except KeyError as e:
            raise ValueError(f"agentshare connector: kv_connector_extra_config lacks {e}") from None
        self.vllm_block_size = self.block_size = vllm_config.cache_config.block_size
        self.layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self.store = KVStore(root, fmt=kv_format(vllm_config, kv_cache_config, self.family),
                             capacity_bytes=capacity, role=role.name.lower(), parts=self.parts)
        self.store.describe({"block_size": self.block_size, "family": self.family, "parts": self.parts,
                             "layout": str(kv_cache_config.kv_cache_layout),
                             "dtype": str(getattr(kv_cache_config.kv_cache_groups[0].kv_cache_spec, "dtype", ""))})
        self._plans: dict[str, _Plan] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._counted: set[str] = set()
        self._kv: list[torch.Tensor] = []
        self._load_errors: dict[str, set[int]] = {}  # request -> its blocks that failed to load, this step

    # -- scheduler side -----------------------------------------------------------------------

    def _module_of(self, request: Request) -> str:
        lora = getattr(request, "lora_request", None)
        return lora.lora_name if lora is not None else self.served

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        p = request_params(request)
        if p is None:
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        if p["op"] == "save":  # the base computes every prompt position
            n = min(p["n"], len(tokens))
            blocks = prefix_blocks(tokens[:n], family=self.family, salt=p.get("salt", ""), block_size=self.block_size)
            todo = [b for b in blocks if not self.store.contains(b.key)]
            if todo:
                self._plans[request.request_id] = _Plan("save", n, tokens[:n], todo)
            return 0, False
        # a decode instance computes at least the last prompt position itself
        n = min(p["n"], max(len(tokens) - 1, 0))
        blocks = prefix_blocks(tokens[:n], family=self.family, salt=p.get("salt", ""), block_size=self.block_size)
        if self.modules.get(self._module_of(request)) != self.family:
            self._count_once(request.request_id, refused=True)
            return 0, False
        if num_computed_tokens >= n:
            self._count_once(request.request_id)
            return 0, False
        need = [b for b in blocks if b.end > num_computed_tokens]
        # Claimed even when blocks are missing (the frontend asks only once they are in the store
        # and pinned, so a miss is a fault): the load then fails and vLLM fails the request.
        # Reporting no match instead would let the module compute the prefix itself under the
        # shared cache salt, and vLLM's prefix cache would later serve that KV as the base's.
        missing = not all(self.store.contains(b.key) for b in need)
        self._plans[request.request_id] = _Plan("load", n, tokens[:n], need, missing=missing)
        return n - num_computed_tokens, False

    def _count_once(self, request_id: str, *, refused: bool = False, hit_tokens: int = 0) -> None:
        """A request's lookup, counted once however often vLLM asks (it asks again for a request
        it could not schedule), when its outcome is known."""
        if request_id in self._counted:
            return
        self._counted.add(request_id)
        c = self.store.counters
        c.lookups += 1
        c.refused_lookups += refused
        if hit_tokens:
            c.hit_lookups += 1
            c.hit_tokens += hit_tokens
        self.store.publish()

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None or plan.op != "load":
            return
        if num_external_tokens == 0:
            del self._plans[request.request_id]  # vLLM chose not to load (e.g. a longer local hit)
        self._count_once(request.request_id, hit_tokens=0 if plan.missing else num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = AgentshareMetadata()
        done: dict[str, int] = {}
        for req in scheduler_output.scheduled_new_reqs:
            self._block_ids[req.req_id] = list(req.block_ids[0])
            done[req.req_id] = req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req.req_id, 0)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if new is not None and rid in self._block_ids:
                if rid in cached.resumed_req_ids:  # after a preemption: the whole list again
                    self._block_ids[rid] = list(new[0])
                else:
                    self._block_ids[rid].extend(new[0])
            done[rid] = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(rid, 0)
        for rid, plan in list(self._plans.items()):
            if rid not in done:
                continue
            t = Transfer(rid, list(self._block_ids.get(rid, [])), plan.tokens, plan.blocks)
            if plan.op == "load":
                meta.loads.append(t)  # the first step that schedules it: load before the forward
                del self._plans[rid]
            elif done[rid] >= plan.n:
                meta.saves.append(t)  # the step that completes the prefix: save after it
                del self._plans[rid]
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._plans.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)
        self._counted.discard(request.request_id)
        return False, None

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kv = [kv_caches[name] for name in self.layer_names]
        for name, t in zip(self.layer_names, kv, strict=True):
            if t.dim() != 4 or self.vllm_block_size % t.shape[2]:
                raise ValueError(f"agentshare connector: layer {name} has a KV view of shape "
                                 f"{tuple(t.shape)}; expected [blocks, heads, tokens, channels]")
        self._kv = kv
        if self.parts > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            self.part = get_tensor_model_parallel_rank()

    def _kernel_blocks(self, block_ids: list[int], b: StoreBlock) -> torch.Tensor:
        """The kernel blocks of the scheduler block that holds store block ``b``."""
        ratio = self.vllm_block_size // self._kv[0].shape[2]
        mb = block_ids[b.start // self.vllm_block_size]
        return torch.arange(mb * ratio, (mb + 1) * ratio, device=self._kv[0].device)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AgentshareMetadata)
        for t in meta.loads:
            for b in t.blocks:
                raw = self.store.get(b.key, parent=b.parent, tokens=t.tokens[b.start:b.end], part=self.part)
                if raw is None:
                    # missing or not what its key says: never served as the base's KV. vLLM fails
                    # the request (kv_load_failure_policy "fail", set by the launcher) and drops the block
                    if t.request_id not in self._load_errors:
                        self.store.counters.failed_loads += 1
                    self._load_errors.setdefault(t.request_id, set()).add(
                        t.block_ids[b.start // self.vllm_block_size])
                    log.warning("agentshare connector: store block %s of request %s is missing or does not "
                                "match; the request fails", b.key.hex()[:16], t.request_id)
                    continue
                kb = self._kernel_blocks(t.block_ids, b)
                src = torch.from_numpy(raw).view(self._kv[0].dtype).to(self._kv[0].device)  # once a block
                for layer, kv in enumerate(self._kv):
                    kv[kb] = src[layer]
        self.store.publish()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = {block for blocks in self._load_errors.values() for block in blocks}
        self._load_errors.clear()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copies every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # wait_for_save copies every layer after the forward

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, AgentshareMetadata)
        if not meta.saves:
            return
        for t in meta.saves:
            for b in t.blocks:
                kb = self._kernel_blocks(t.block_ids, b)
                kv = torch.stack([layer[kb] for layer in self._kv])  # [layers, kernel blocks, H, N, C]
                raw = kv.contiguous().view(torch.uint8).cpu().numpy()
                self.store.put(b.key, parent=b.parent, tokens=t.tokens[b.start:b.end], kv=raw, part=self.part)
        self.store.evict()
        self.store.publish()
