"""Build an engine from a model directory and a set of decode modules.

>>> core = load_engine(model_dir, modules={"coder": coder_dir}, dtype="float32")
>>> {name: (m.kind, m.shares_prefill) for name, m in core.modules.items()}
{'base': ('base', True), 'coder': ('lora', True)}
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch

from server.engine.core import EngineConfig, EngineCore
from server.engine.detokenize import Decoder
from server.engine.forward import LlamaForward
from server.engine.modules import base_module, load_module
from server.engine.numerics import dtype_name, resolve_dtype, set_threads
from server.kv.family import family_digest
from server.models.loader import load_model


def load_engine(
    model_dir: Path | str,
    *,
    modules: Mapping[str, Path | str] | None = None,
    dtype: str | torch.dtype = "auto",
    threads: int | None = None,
    config: EngineConfig = EngineConfig(),
    base_name: str = "base",
) -> EngineCore:
    """An :class:`EngineCore` serving the base model (as ``base_name``) and ``modules``.

    The family digest covers the base's weights, tokenizer, config and the KV dtype, so modules
    trained for this base in this dtype share its prefill; others get private prefills.
    """
    set_threads(threads)
    dt = resolve_dtype(dtype)
    loaded = load_model(model_dir)
    forward = LlamaForward.from_hf(loaded.model, dtype=dt)
    family = family_digest(model_dir, kv_dtype=dtype_name(dt))
    table = {base_name: base_module(family, base_name)}
    for name, path in (modules or {}).items():
        if name in table:
            raise ValueError(f"module name {name!r} is used twice")
        table[name] = load_module(path, name=name, family=family, shape=forward.weights.shape, dtype=dt)
    tok = cast(Decoder, loaded.tokenizer)  # a transformers tokenizer
    eos = {t for t in (getattr(tok, "eos_token_id", None),) if t is not None}
    gen_eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    return EngineCore(forward, tok, family=family, modules=table, eos_token_ids=tuple(sorted(eos)), config=config)
