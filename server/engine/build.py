"""Build an engine from a model directory and a set of decode modules; start one for a serving
process (:func:`start_engine`: the colocated server and every cluster worker).

>>> core = load_engine(model_dir, modules={"coder": coder_dir}, dtype="float32")
>>> {name: (m.kind, m.shares_prefill) for name, m in core.modules.items()}
{'base': ('base', True), 'coder': ('lora', True)}
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch

from server.engine import vllm_attention, vllm_elementwise, vllm_matmul
from server.engine.async_engine import AsyncEngine
from server.engine.core import EngineConfig, EngineCore
from server.engine.cuda import device_name
from server.engine.detokenize import Decoder
from server.engine.device import resolve_device
from server.engine.elementwise import KernelSpec
from server.engine.forward import LlamaForward
from server.engine.modules import base_module, load_module
from server.engine.numerics import (
    choose_threads,
    cpu_bf16,
    cpu_model,
    dtype_name,
    resolve_dtype,
    set_threads,
)
from server.kv.family import family_parts
from server.models.loader import load_model
from server.models.patch import resolve_model_dir
from server.process import keep_freed_memory

log = logging.getLogger("agentshare.engine")


def load_engine(
    model_dir: Path | str,
    *,
    modules: Mapping[str, Path | str] | None = None,
    dtype: str | torch.dtype = "auto",
    threads: int | None = None,
    config: EngineConfig = EngineConfig(),
    base_name: str = "base",
    device: str | torch.device = "cpu",
) -> EngineCore:
    """An :class:`EngineCore` serving the base model (as ``base_name``) and ``modules`` on
    ``device`` (``server/engine/device.py``: ``auto``, ``cpu``, ``cuda:N``); ``dtype`` ``auto``
    is bf16 where the device computes it natively.

    The family digest covers the base's weights, tokenizer, config and the KV dtype, so modules
    trained for this base in this dtype share its prefill; others get private prefills (on any
    device: the family does not name one), except a LoRA trained on another base, which is
    refused (its manifest names a family that is this base at no KV dtype).
    """
    set_threads(threads)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev.type)
    model_dir = resolve_model_dir(model_dir)
    loaded = load_model(model_dir)
    forward = LlamaForward.from_hf(loaded.model, dtype=dt, device=dev)
    parts = family_parts(model_dir, kv_dtype=dtype_name(dt))
    family, families = parts.digest, parts.at_every_kv_dtype()
    table = {base_name: base_module(family, base_name)}
    for name, path in (modules or {}).items():
        if name in table:
            raise ValueError(f"module name {name!r} is used twice")
        table[name] = load_module(path, name=name, family=family, base_families=families,
                                  shape=forward.weights.shape, dtype=dt, device=dev)
    tok = cast(Decoder, loaded.tokenizer)  # a transformers tokenizer
    eos = {t for t in (getattr(tok, "eos_token_id", None),) if t is not None}
    gen_eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    return EngineCore(forward, tok, family=family, modules=table, eos_token_ids=tuple(sorted(eos)), config=config)


def start_engine(
    model_dir: Path | None,
    *,
    modules: Mapping[str, Path] | None = None,
    dtype: str | torch.dtype = "auto",
    threads: int | None = None,
    config: EngineConfig = EngineConfig(),
    base_name: str = "base",
    device: str | torch.device = "auto",
) -> AsyncEngine:
    """The engine of a serving process, on its own thread: the thread budget chosen
    (:func:`~server.engine.numerics.choose_threads`), glibc told to keep freed memory
    (:func:`~server.process.keep_freed_memory`, before anything large is allocated), the core
    loaded on the engine thread (:meth:`AsyncEngine.load`), on a CPU the fused elementwise
    kernels loaded or their build started (``server/engine/elementwise.py``; off with
    ``AGENTSHARE_FUSED=off``), and the choices logged (event ``engine``: threads, device, dtype,
    KV pool, fused kernels). ``model_dir`` None: the default model."""
    choice = choose_threads(threads)
    dev = resolve_device(device)  # a bad --device fails here, in the caller, before the thread starts
    kept = keep_freed_memory()

    def build() -> EngineCore:
        path = resolve_model_dir(model_dir)
        log.info("loading", extra={"event": "load", "model_dir": str(path), "modules": ",".join(modules or {})})
        core = load_engine(path, modules=modules, dtype=dtype, threads=choice.threads, config=config,
                           base_name=base_name, device=dev)
        fused = "off"
        if dev.type == "cpu" and os.environ.get("AGENTSHARE_FUSED", "auto") != "off":
            fused = "loaded" if core.forward.fused.await_build(KernelSpec.of(core.forward.weights)) else "building"
        log.info("engine", extra={"event": "engine", "threads": torch.get_num_threads(), "threads_from": choice.source,
                                  "physical_cores": choice.physical_cores, "device": str(dev),
                                  "device_name": device_name(dev), "cpu": cpu_model(), "cpu_bf16": cpu_bf16(),
                                  "device_from": "auto" if str(device) == "auto" else "option",
                                  "kv_pool_bytes": core.kv.total_bytes, "kv_blocks": core.kv.num_blocks,
                                  "dtype": str(core.forward.weights.dtype),
                                  "linears": core.forward.weights.layers[0].qkv.kernel,
                                  "vllm_matmul": vllm_matmul.status(),
                                  "decode_attention": "vllm" if core.runner.whole_sequences else "cascade",
                                  "vllm_attention": vllm_attention.status(),
                                  "decode_elementwise": "vllm" if core.forward.small is not None else "torch",
                                  "vllm_elementwise": vllm_elementwise.status(),
                                  "malloc_keeps_freed": kept, "fused_kernels": fused})
        return core

    return AsyncEngine.load(build)
