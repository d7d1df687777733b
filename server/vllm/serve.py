"""``agentshare serve --engine vllm``: start the vLLM instances, then serve the API over them; and
``agentshare vllm-node``: start a node's instances (:mod:`server.vllm.node`), then serve its API.

The API process loads no weights: it renders prompts (the model's tokenizer and chat template),
computes the family digest, and routes (:class:`~server.vllm.backend.VllmBackend`).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.api.config import ServerConfig

if TYPE_CHECKING:
    from server.cluster.auth import ClusterSecret
    from server.vllm.backend import VllmBackend
    from server.vllm.launch import VllmInstances
    from server.vllm.node import Node

log = logging.getLogger("agentshare.vllm")


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmOptions:
    """What only the vllm engine takes."""

    store_bytes: int = 2 << 30  # the shared-memory KV store's capacity
    lora_instances: int = 1  # instances the LoRA modules are dealt to
    enforce_eager: bool = False  # no compilation of the base and full instances (faster start)
    placement_policy: str = "offload"  # picks among an agent's places (here, nodes): server/policy/placement.py
    tensor_parallel: int = 1  # ranks per instance (vLLM's --tensor-parallel-size), the same for every instance
    start_timeout: float = 900.0


def context_limit(model_dir: Path, dtype: str, kv_cache_bytes: int, tensor_parallel: int = 1) -> int:
    """The longest context the instances serve: the model's, capped at what ``kv_cache_bytes`` of
    KV hold on each of ``tensor_parallel`` ranks, which hold their share of the KV heads (vLLM
    refuses to start when one request of the model's full length does not fit its KV space; the
    API refuses longer prompts with a 413)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    max_context = int(cfg.get("max_position_embeddings", 4096))
    heads = int(cfg.get("num_key_value_heads", cfg.get("num_attention_heads", 1)))
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if heads % tensor_parallel:
        sizes = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
        raise ValueError(f"--tensor-parallel-size {tensor_parallel} does not divide the model's {heads} KV heads "
                         f"(each rank holds whole heads): use one of {sizes}")
    per_token = 2 * int(cfg["num_hidden_layers"]) * heads // tensor_parallel * head_dim * (4 if dtype == "float32" else 2)
    fits = kv_cache_bytes // per_token // 256 * 256
    if fits < 256:
        raise ValueError(f"--kv-cache {kv_cache_bytes} bytes holds {fits} tokens of this model's KV "
                         f"({per_token} bytes a token); give it more")
    if fits < max_context:
        log.warning("context capped", extra={"event": "vllm_context", "max_context": fits,
                                             "model_max": max_context, "kv_cache_bytes": kv_cache_bytes})
    return min(fits, max_context)


class PlanError(ValueError):
    """The options cannot serve this model and these modules (found before any instance starts):
    the command line says so as a usage error."""


@dataclass(frozen=True, slots=True)
class _Planned:
    """One host's instances, planned and created (not started), with what they were planned from."""

    model_dir: Path
    family: str
    max_context: int
    instances: VllmInstances


def _plan(config: ServerConfig, options: VllmOptions, *, with_base: bool) -> _Planned:
    from server.engine.device import DEFAULT_CPU_KV_BYTES
    from server.engine.numerics import dtype_name, resolve_dtype
    from server.kv.family import family_parts
    from server.models.patch import resolve_model_dir
    from server.modules.manifest import ManifestError
    from server.modules.registry import ModuleLoadError
    from server.vllm.launch import VllmInstances, plan_instances

    model_dir = resolve_model_dir(config.model_dir)
    dtype = dtype_name(resolve_dtype(config.dtype))
    parts = family_parts(model_dir, kv_dtype=dtype)
    family = parts.digest
    kv_bytes = config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES  # each instance's --kv-cache-memory-bytes
    try:
        max_context = context_limit(model_dir, dtype, kv_bytes, options.tensor_parallel)
        plan = plan_instances(model_dir, config.modules, family=family, dtype=dtype,
                              base_families=parts.at_every_kv_dtype(), base_name=config.base_name,
                              lora_instances=options.lora_instances, enforce_eager=options.enforce_eager,
                              with_base=with_base)
    except (ModuleLoadError, ManifestError):
        raise  # a module that cannot be served: the CLI's one line, as on the torch engine
    except ValueError as exc:  # the options and the model disagree: nothing has started
        raise PlanError(str(exc)) from None
    for spec in plan:
        log.info("plan", extra={"event": "vllm_plan", "instance": spec.name, "agents": ",".join(spec.modules),
                                "compile": spec.compile})
    instances = VllmInstances(plan, dtype=dtype, max_model_len=max_context, capacity_bytes=options.store_bytes,
                              family=family, kv_cache_bytes=kv_bytes, tensor_parallel=options.tensor_parallel)
    return _Planned(model_dir, family, max_context, instances)


def start_backend(config: ServerConfig, options: VllmOptions = VllmOptions(), *, nodes: Sequence[str] = (),
                  secret: ClusterSecret | None = None) -> VllmBackend:
    """Plan and start the instances; the :class:`VllmBackend` that serves from them, and from the
    agents of ``nodes`` (``agentshare vllm-node`` URLs, reached with ``secret``)."""
    from transformers import AutoTokenizer

    from server.vllm.backend import VllmBackend
    from server.vllm.node import NodeClient

    if nodes and secret is None:
        raise ValueError("--node needs the cluster secret the nodes were given: --cluster-secret-file PATH")
    p = _plan(config, options, with_base=True)
    clients: list[NodeClient] = []
    try:
        p.instances.start(timeout=options.start_timeout)
        for i, url in enumerate(nodes):
            assert secret is not None
            clients.append(NodeClient.connect(url, secret, name=f"node-{i}", timeout=options.start_timeout))
        tokenizer = AutoTokenizer.from_pretrained(p.model_dir)
        return VllmBackend(p.instances, tokenizer=tokenizer, family=p.family, modules=dict(config.modules),
                           max_context=p.max_context, base_name=config.base_name, nodes=clients,
                           placement_policy=options.placement_policy)
    except BaseException:
        for c in clients:
            c.close()
        p.instances.close()
        raise


def start_node(config: ServerConfig, options: VllmOptions, *, secret: ClusterSecret, kv_host: str,
               kv_port: int = 0, advertise: str | None = None) -> Node:
    """Plan and start a node's instances (its agents, no base) and open their store."""
    from server.vllm.node import Node
    from server.vllm.store import open_store

    if not config.modules:
        raise ValueError("a vllm node serves agents: give it at least one --module NAME=PATH")
    p = _plan(config, options, with_base=False)
    try:
        p.instances.start(timeout=options.start_timeout)
        store, facts = open_store(p.instances.store.root, capacity_bytes=options.store_bytes, role="node")
        return Node(p.instances, store, facts, family=p.family, modules=dict(config.modules), secret=secret,
                    kv_host=kv_host, kv_port=kv_port, advertise=advertise)
    except BaseException:
        p.instances.close()
        raise


def _run(app: Any, config: ServerConfig, close: Callable[[], None]) -> None:
    """Serve ``app`` until interrupted, then ``close`` (which stops the instances)."""
    import uvicorn

    # uvicorn re-raises the SIGTERM it caught; exit through Python so the instances are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_config=None, access_log=False,
                    log_level=config.log_level.lower(), timeout_graceful_shutdown=5)
    finally:
        close()


def serve_node(config: ServerConfig, options: VllmOptions, *, secret: ClusterSecret, kv_port: int = 0,
               advertise: str | None = None) -> None:
    """``agentshare vllm-node``: serve a node's API on ``config.host:config.port`` (blocks)."""
    from server.api.logs import configure_logging
    from server.vllm.node import create_node_app

    configure_logging(config.log_level)
    node = start_node(config, options, secret=secret, kv_host=config.host, kv_port=kv_port, advertise=advertise)
    _run(create_node_app(node), config, node.close)


def serve_vllm(config: ServerConfig, options: VllmOptions = VllmOptions(), *, nodes: Sequence[str] = (),
               secret: ClusterSecret | None = None) -> None:
    """Serve until interrupted (blocks)."""
    from server import tracing
    from server.api.app import create_app
    from server.api.logs import configure_logging

    configure_logging(config.log_level)
    tracing.configure("agentshare")
    backend = start_backend(config, options, nodes=nodes, secret=secret)
    for name, card in backend.facts.agents.items():
        log.info("agent", extra={"event": "agent", "agent": name, "kind": card.kind,
                                 "shares_prefill": card.shares_prefill, "reason": card.reason})
    _run(create_app(backend, config, owns_engine=True), config, backend.close)
