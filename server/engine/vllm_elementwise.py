"""A layer's elementwise work through the vllm package's CPU ops, where it is installed.

Eager torch runs each region as several ops over a step's rows (RMSNorm alone: cast, square,
mean, add, rsqrt, multiply, cast, scale), each a dispatch of a few microseconds: at decode sizes
a layer's elementwise work is about twenty dispatches, some 600 a step of the default model.
vLLM's CPU build carries each region as one op, with fp32 arithmetic inside and one rounding of
each output:

* ``_C::rms_norm``: RMSNorm of the input rows;
* ``_C::fused_add_rms_norm``: the residual add and the next RMSNorm, in place (the residual
  rows become ``h + delta``, the delta rows their norm);
* ``_C::rotary_embedding``: RoPE of q and k in place, reading the rows of the step's ``qkv``
  output where they are (its row stride), cos and sin looked up by position in one table;
* ``_C::silu_and_mul``: SiLU(gate)·up of the packed ``[gate | up]`` rows.

:class:`VllmRegions` serves the forward's regions (:class:`~server.engine.elementwise.Regions`)
with them for bf16 steps on the CPU, for Llama-shaped layers (no q/k norms). Each output is at
least as close to the fp32 computation as the eager ops' (the eager ones round the fp32 norm to
bf16 before the scale, and each RoPE product); ``tests/vllm/test_vllm_elementwise.py`` checks
that against fp32 and the forward's logits against the eager ones'. ``AGENTSHARE_VLLM_ELEMENTWISE=off``
turns them off. :func:`status` says why they are off, for the server's start-up log.

>>> status() == "on" or status().startswith("off")
True
"""

from __future__ import annotations

import functools

import torch

from server.engine import vllm_ops
from server.engine.rope import Rope
from server.engine.weights import ModelWeights

SWITCH = "AGENTSHARE_VLLM_ELEMENTWISE"

_SCHEMAS = {
    "rms_norm": "_C::rms_norm(Tensor($0! -> ) out, Tensor input, Tensor? weight, float epsilon) -> ()",
    "fused_add_rms_norm": (
        "_C::fused_add_rms_norm(Tensor($0! -> ) input, Tensor($1! -> ) residual, Tensor? weight, float epsilon) -> ()"),
    "silu_and_mul": "_C::silu_and_mul(Tensor($0! -> ) out, Tensor input) -> ()",
    "rotary_embedding": (
        "_C::rotary_embedding(Tensor positions, Tensor($0! -> ) query, Tensor($1! -> )? key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()"),
}


@functools.cache
def status() -> str:
    """``"on"``, or why every step keeps torch's ops."""
    for name, schema in _SCHEMAS.items():
        why = vllm_ops.op_status(name, schema, SWITCH)
        if why != "on":
            return why
    return "on"


def serves(weights: ModelWeights) -> bool:
    """True if this forward's steps can take the ops: bf16 on the CPU, Llama-shaped layers."""
    return (weights.embed.device.type == "cpu" and weights.dtype == torch.bfloat16
            and weights.layers[0].q_norm is None and status() == "on")


class VllmRegions:
    """The four regions on vLLM's ops, for one forward (its norm epsilon, its RoPE table).

    ``positions`` are the rope tables of a step (:meth:`tables`): the ops look cos and sin up
    in a table of every position the model takes, ``[max_context, head_dim]`` (cos, then sin,
    of the ``head_dim / 2`` frequencies), built once in the weights' dtype as transformers
    casts its own.
    """

    __slots__ = ("cos_sin", "eps", "head_dim")

    def __init__(self, weights: ModelWeights, rope: Rope) -> None:
        s = weights.shape
        cos, sin = rope.cos_sin(torch.arange(s.max_context), weights.dtype)
        half = s.head_dim // 2
        self.cos_sin = torch.cat((cos[:, :half], sin[:, :half]), dim=-1).contiguous()
        self.eps, self.head_dim = s.rms_norm_eps, s.head_dim

    def tables(self, rope: Rope, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return (positions,)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()  # the op reads rows as contiguous
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, weight, self.eps)
        return out

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, delta = h.contiguous(), delta.contiguous()
        torch.ops._C.fused_add_rms_norm(delta, h, weight, self.eps)  # h += delta; delta = norm(h)
        return h, delta

    def rope(self, qkv: torch.Tensor, heads: int, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
        width = heads * self.head_dim
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        qk = qkv[:, :width]
        torch.ops._C.rotary_embedding(tables[0], qk, None, self.head_dim, self.cos_sin, True)
        return qk.view(qkv.shape[0], heads, self.head_dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        torch.ops._C.silu_and_mul(out, gate_up)
        return out
