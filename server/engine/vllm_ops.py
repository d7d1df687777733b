"""The vllm package's compiled CPU ops (``torch.ops._C``), loaded once for every engine kernel
taken from them (:mod:`server.engine.vllm_matmul`, :mod:`server.engine.vllm_attention`).

The library is loaded by path: ``importlib`` finds the package without importing vllm (about
10 ms). It is loaded only on CPUs with AVX512-BF16, the ISA of vLLM's ``_C`` build. Each kernel
is used only if the library registers its op with the signature the engine calls, and only
unless its environment switch turns it off.

>>> op_status("onednn_mm", "no such schema", "AGENTSHARE_VLLM_MATMUL").startswith("off")
True
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import torch


@functools.cache
def load_library() -> str | None:
    """Load the vllm package's compiled CPU ops (``torch.ops._C``) once: None when they are
    there, else why not. Shared by every engine kernel taken from that library."""
    if not (torch.backends.mkldnn.is_available() and torch.cpu._is_avx512_bf16_supported()):
        return "off: this CPU has no AVX512-BF16, the ISA of vLLM's CPU build"
    if hasattr(torch.ops._C, "onednn_mm"):
        return None
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return "off: the vllm package is not installed (the vllm extra)"
    lib = Path(next(iter(spec.submodule_search_locations))) / "_C.abi3.so"
    if not lib.is_file():
        return f"off: {lib} is missing (a vllm build without CPU ops)"
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as exc:
        return f"off: {lib} did not load ({type(exc).__name__}: {exc})"
    return None


def switched_off(variable: str) -> bool:
    """True if the environment variable turns a kernel off (``0``, ``off``, ``false``, ``no``)."""
    return os.environ.get(variable, "on").lower() in ("0", "off", "false", "no")


def op_status(name: str, schema: str, switch: str) -> str:
    """``"on"`` if ``torch.ops._C.<name>`` is there with ``schema``, else why not."""
    if switched_off(switch):
        return f"off ({switch})"
    why = load_library()
    if why is not None:
        return why
    op = getattr(torch.ops._C, name, None)
    if op is None or str(op.default._schema) != schema:
        return f"off: this vllm build's _C::{name} is not the one this engine calls"
    return "on"
