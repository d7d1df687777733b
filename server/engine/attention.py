"""Attention as a cascade of partials merged through their log-sum-exp.

A query's keys are split into disjoint parts, each attended separately; a part returns its
softmax-weighted values ``o_i`` and the log-sum-exp ``l_i`` of its scores, and the parts merge
exactly::

    l = log(sum_i exp(l_i))            o = sum_i exp(l_i - l) * o_i

The engine uses up to three parts per query (docs/design.md §4)::

    positions:  0 ........ P-1 | P ....... start-1 | start ... start+n-1
                shared prefix  | request's history | the new chunk
                (one strided   | (its own slots)   | (causal among
                 view, read once                   |  themselves)
                 for the batch)

Layout conventions (GQA: ``G = num_heads // num_kv_heads`` query heads share a KV head):
queries ``[T, Hkv, G, D]``; the KV cache ``[Hkv, slots, D]`` (``server.kv.storage``).

On the CPU each part runs torch's flash kernel, which returns the LSE alongside the output. On
a CUDA device two of torch's kernels are candidates, fastest first: the flash kernel (bf16 and
fp16, no additive mask: prefill chunks and their reads of a prefix) and the memory-efficient
one (any dtype, additive masks: decode rows). Both return the LSE. On the first call of each
kind (dtype, causal, masked) each candidate in turn is checked against
:func:`reference_partial` (an explicit ``matmul + logsumexp``); the first that agrees serves
that kind from then on, and where none does, the failures are logged and the reference serves
it (:data:`KERNELS` says which serves what).

>>> q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 16)
>>> a = reference_partial(q, k[..., :3, :], v[..., :3, :])
>>> b = reference_partial(q, k[..., 3:, :], v[..., 3:, :])
>>> o, _ = merge_partials([a, b])
>>> torch.allclose(o, reference_partial(q, k, v).out, atol=1e-6)
True
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger("agentshare.engine")

KERNELS: dict[tuple[str, str, bool, bool], str] = {}
"""Which kernel serves each kind of partial on a device: ``(device type, dtype, causal, masked)``
-> ``"flash"``, ``"efficient"`` or ``"reference"`` (filled on first use; the device check reports it)."""

_AGREE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
"""How far a device kernel's output may lie from the fp32 reference on its first call."""


@dataclass(frozen=True, slots=True)
class Partial:
    """Attention over one part of the keys: output ``[..., L, D]`` and LSE ``[..., L]`` (fp32)."""

    out: torch.Tensor
    lse: torch.Tensor


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> Partial:
    """Softmax attention of ``q`` [B, H, Lq, D] over ``k``/``v`` [B, H, Lk, D] with its LSE.

    ``causal`` masks key ``j > i`` (top-left aligned: use it when Lq == Lk); ``mask`` is an
    additive mask broadcastable to [B, H, Lq, Lk]. Inputs may be strided views (e.g. expanded
    KV heads, or blocks of the KV storage); nothing is copied on the CPU path.

    >>> q = torch.randn(1, 2, 3, 8); kv = torch.randn(1, 2, 3, 8)
    >>> p = partial_attention(q, kv, kv, causal=True)
    >>> torch.allclose(p.out, reference_partial(q, kv, kv, causal=True).out, atol=1e-6)
    True
    """
    if q.device.type == "cpu":
        if mask is not None:
            mask = mask.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
        return Partial(out, lse)
    if q.device.type == "cuda":
        return _checked_device_partial(q, k, v, causal=causal, mask=mask, scale=scale)
    return reference_partial(q, k, v, causal=causal, mask=mask, scale=scale)


def _checked_device_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, mask: torch.Tensor | None,
    scale: float | None,
) -> Partial:
    kind = (q.device.type, str(q.dtype).removeprefix("torch."), causal, mask is not None)
    chosen = KERNELS.get(kind)
    if chosen is not None and chosen != "reference":
        try:
            return _kernel(chosen)(q, k, v, causal=causal, mask=mask, scale=scale)
        except RuntimeError as exc:  # a layout this kind had not shown before: the reference serves it
            log.warning("the device attention kernel refused a call; the reference serves it",
                        extra={"event": "attention_kernel", "kind": str(kind), "kernel": chosen,
                               "why": f"{type(exc).__name__}: {exc}"})
            return reference_partial(q, k, v, causal=causal, mask=mask, scale=scale)
    ref = reference_partial(q, k, v, causal=causal, mask=mask, scale=scale)
    if chosen is None:  # first call of this kind: which candidate agrees with the reference?
        KERNELS[kind] = "reference"
        for name in candidates(q.dtype, masked=mask is not None):
            try:
                got = _kernel(name)(q, k, v, causal=causal, mask=mask, scale=scale)
                out_err = float((got.out.float() - ref.out.float()).abs().max())
                lse_err = float((got.lse - ref.lse).abs().max())
                ok = out_err <= _AGREE.get(q.dtype, 1e-2) and lse_err <= 1e-3
                why = f"max |out - reference| {out_err:.2e}, |lse - reference| {lse_err:.2e}"
            except RuntimeError as exc:  # not supported for this shape, dtype or device
                ok, why = False, f"{type(exc).__name__}: {exc}"
            if ok:
                KERNELS[kind] = name
                break
            log.warning("a device attention kernel disagrees; the next candidate or the reference serves this kind",
                        extra={"event": "attention_kernel", "kind": str(kind), "kernel": name, "why": why})
    return ref


def candidates(dtype: torch.dtype, *, masked: bool) -> tuple[str, ...]:
    """The device kernels tried for a kind of partial, fastest first.

    >>> candidates(torch.bfloat16, masked=False), candidates(torch.float32, masked=False)
    (('flash', 'efficient'), ('efficient',))
    """
    flash = not masked and dtype in (torch.bfloat16, torch.float16)
    return ("flash", "efficient") if flash else ("efficient",)


def _kernel(name: str):  # looked up per call, so that tests may stand in for either kernel
    return {"flash": flash_partial, "efficient": efficient_partial}[name]


def flash_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
    mask: torch.Tensor | None = None, scale: float | None = None,
) -> Partial:
    """:func:`partial_attention` through torch's flash kernel (CUDA devices; bf16 and fp16, no
    additive mask). Keys broadcast over query heads (stride 0) and any tensor whose last
    dimension is strided are laid out for it; its LSE comes back in fp32."""
    if mask is not None:
        raise RuntimeError("the flash kernel takes no additive mask")
    if k.stride(1) == 0 and k.shape[1] > 1:
        k, v = k.contiguous(), v.contiguous()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return Partial(out, lse[..., : q.shape[2]].float())


def efficient_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
    mask: torch.Tensor | None = None, scale: float | None = None,
) -> Partial:
    """:func:`partial_attention` through torch's memory-efficient kernel (CUDA devices).

    The kernel reads an additive mask whose rows start 16-element aligned: the mask is laid out
    in a padded buffer and passed as a view, as ``F.scaled_dot_product_attention`` does. Its LSE
    may be padded past the queries (to a multiple of 32): only the queries' part is kept. Keys
    broadcast over query heads (stride 0) are laid out for it.
    """
    if k.stride(1) == 0 and k.shape[1] > 1:
        k, v = k.contiguous(), v.contiguous()
    bias = None
    if mask is not None:
        b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        padded = q.new_zeros(b, h, lq, lk + (-lk % 16))
        padded[..., :lk] = mask.to(q.dtype)
        bias = padded[..., :lk]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=scale)
    return Partial(out, lse[..., : q.shape[2]].float())


def reference_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> Partial:
    """The same as :func:`partial_attention`, spelled out: ``softmax(q k^T * scale + mask) v``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return Partial(out.to(q.dtype), lse)


def merge_partials(parts: list[Partial]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials over disjoint key sets into the attention over their union.

    Outputs must share one shape; the merge runs in fp32 and returns ``(out, lse)`` with
    ``out`` in the first partial's dtype. A part whose keys were all masked (LSE ``-inf``)
    contributes nothing.
    """
    if len(parts) == 1:
        return parts[0].out, parts[0].lse
    if len(parts) == 2:  # the cascade's common case, in closed form: b + sigmoid(l_a - l_b) (a - b)
        a, b = parts
        weight = torch.sigmoid(a.lse - b.lse)
        merged = torch.lerp(b.out.float(), a.out.float(), weight[..., None])
        return merged.to(a.out.dtype), torch.logaddexp(a.lse, b.lse)
    lse = torch.stack([p.lse for p in parts]).logsumexp(dim=0)
    out = torch.zeros(parts[0].out.shape, dtype=torch.float32, device=parts[0].out.device)
    for p in parts:
        weight = torch.exp(p.lse - lse).nan_to_num_(0.0)
        out.addcmul_(p.out.float(), weight[..., None])
    return out.to(parts[0].out.dtype), lse
