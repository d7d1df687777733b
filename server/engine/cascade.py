"""Cascade attention of one layer for a whole step (see ``attention`` and ``batch``).

For every query row the step combines up to three partials, merged by LSE:

* **prefix** — per prefix group, all the group's queries (every request, every GQA head of a
  KV head, folded into one query axis) against ONE strided view of the prefix's blocks: the
  shared K/V are read once per step for the whole batch, never copied or concatenated;
* **decode suffix** — single-token requests, batched: a padded gather of each request's own
  slots (its history and the token just written) with a padding mask; or, where every such
  history is one contiguous range and one is long, a view of each, one request at a time;
* **chunk suffix** — a multi-token chunk attends its history (a view when its slots are
  contiguous, a gather otherwise) and itself, causally, straight from the fresh K/V.

A step whose plan carries each request's whole sequence (a step that reads no shared prefix, or
a few single-token requests) goes instead through one call of vLLM's kernels where they serve
(:mod:`server.engine.vllm_attention`).

>>> import torch
>>> from server.engine.batch import Chunk, plan_step
>>> kc, vc = torch.randn(2, 64, 16), torch.randn(2, 64, 16)         # Hkv=2, 64 slots, D=16
>>> plan = plan_step([Chunk([1, 2, 3], start=0, slots=torch.arange(3))], block_size=16)
>>> q, k, v = torch.randn(3, 2, 2, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
>>> cascade_attention(q, k, v, kc, vc, plan).shape                   # [T, Hkv, G, D]
torch.Size([3, 2, 2, 16])
"""

from __future__ import annotations

import torch

from server.engine import vllm_attention
from server.engine.attention import Partial, merge_partials, partial_attention
from server.engine.batch import ChunkPart, DecodeGroup, PrefixGroup, StepPlan


def cascade_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: StepPlan,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention output [T, Hkv, G, D] of queries ``q`` [T, Hkv, G, D].

    ``k_new``/``v_new`` [T, Hkv, D] are this step's keys/values, already written to
    ``plan.write_slots`` of ``k_cache``/``v_cache`` [Hkv, slots, D], unless the plan says its
    attention writes them (``StepPlan.attention_writes_kv``: vLLM's decode kernel does, as it reads).
    """
    if plan.sequences is not None:  # laid out only where vLLM's kernels serve (the runner asks)
        return vllm_attention.attend(q, k_new, v_new, k_cache, v_cache, plan.sequences, scale)
    t, hkv, g, d = q.shape
    if plan.decode is not None and plan.decode.rows is None and not plan.chunks:
        suffix = _decode_partial(q, k_cache, v_cache, plan.decode, scale)
    elif len(plan.chunks) == 1 and plan.decode is None:
        suffix = _chunk_partial(q, k_new, v_new, k_cache, v_cache, plan.chunks[0], scale)
    else:  # a mixed step: scatter each suffix kind into full-size buffers
        out = q.new_empty(t, hkv, g, d)
        lse = torch.empty(t, hkv, g, dtype=torch.float32, device=q.device)
        if plan.decode is not None:
            p = _decode_partial(q, k_cache, v_cache, plan.decode, scale)
            rows = _all(t, q.device) if plan.decode.rows is None else plan.decode.rows
            out[rows], lse[rows] = p.out, p.lse
        for part in plan.chunks:
            p = _chunk_partial(q, k_new, v_new, k_cache, v_cache, part, scale)
            out[part.lo : part.hi], lse[part.lo : part.hi] = p.out, p.lse
        suffix = Partial(out, lse)

    result = suffix.out
    members = [g for g in plan.prefix_groups if g.member is not None]
    if members:  # a graph's padded step: every row against every prefix, each masked to its group's rows
        parts = [suffix]
        for group in members:
            p = _prefix_partial(q, k_cache, v_cache, group, scale)
            parts.append(Partial(p.out, p.lse + group.member[:, None, None]))  # type: ignore[index]
        result, _ = merge_partials(parts)
        return result
    for group in plan.prefix_groups:
        if group.rows is None:
            result, _ = merge_partials([_prefix_partial(q, k_cache, v_cache, group, scale), suffix])
        else:
            local = Partial(suffix.out[group.rows], suffix.lse[group.rows])
            merged, _ = merge_partials([_prefix_partial(q, k_cache, v_cache, group, scale), local])
            if result is suffix.out:
                result = suffix.out.clone()
            result[group.rows] = merged
    return result


def _prefix_partial(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: PrefixGroup, scale: float | None
) -> Partial:
    qg = q if group.rows is None else q[group.rows]
    rows, hkv, g, d = qg.shape
    # fold (row, head-in-group) into one query axis: every query of the group meets the prefix
    # in one kernel call over one strided view of its blocks
    # (KV heads as the batch axis, one head each: the CPU kernel ran 25 % faster on decode-sized
    # queries than with the KV heads as heads)
    folded = qg.permute(1, 0, 2, 3).reshape(hkv, 1, rows * g, d)
    end = group.slot_start + group.num_tokens
    k = k_cache[:, group.slot_start : end].unsqueeze(1)
    v = v_cache[:, group.slot_start : end].unsqueeze(1)
    p = partial_attention(folded, k, v, scale=scale)
    out = p.out.reshape(hkv, rows, g, d).permute(1, 0, 2, 3)
    lse = p.lse.reshape(hkv, rows, g).permute(1, 0, 2)
    return Partial(out, lse)


def _decode_partial(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float | None
) -> Partial:
    qd = q if group.rows is None else q[group.rows]  # [R, Hkv, G, D]: batch R, heads Hkv, len G
    if group.spans is not None:  # long contiguous histories: one view each, nothing copied
        # KV heads as the batch axis, one head each, as the prefix partial reads a prefix
        parts = [partial_attention(qd[i].unsqueeze(1), k_cache[:, span].unsqueeze(1), v_cache[:, span].unsqueeze(1),
                                   scale=scale) for i, span in enumerate(group.spans)]
        return Partial(torch.stack([p.out.squeeze(1) for p in parts]), torch.stack([p.lse.squeeze(1) for p in parts]))
    r, width = group.gather.shape
    hkv, _, d = k_cache.shape
    flat = group.gather.reshape(-1)
    k = k_cache.index_select(1, flat).view(hkv, r, width, d).transpose(0, 1)
    v = v_cache.index_select(1, flat).view(hkv, r, width, d).transpose(0, 1)
    return partial_attention(qd, k, v, mask=group.mask, scale=scale)


def _chunk_partial(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    part: ChunkPart,
    scale: float | None,
) -> Partial:
    qc = q[part.lo : part.hi].permute(1, 2, 0, 3)  # [Hkv, G, n, D]: batch Hkv, heads G
    hkv, g, n, d = qc.shape
    # KV heads are broadcast over their G query heads with stride 0: no copy
    kc = k_new[part.lo : part.hi].permute(1, 0, 2).unsqueeze(1).expand(hkv, g, n, d)
    vc = v_new[part.lo : part.hi].permute(1, 0, 2).unsqueeze(1).expand(hkv, g, n, d)
    parts = [partial_attention(qc, kc, vc, causal=True, scale=scale)]
    if part.history is not None:
        if isinstance(part.history, slice):
            kh, vh = k_cache[:, part.history], v_cache[:, part.history]
        else:
            kh, vh = k_cache.index_select(1, part.history), v_cache.index_select(1, part.history)
        # no mask over the history: fold the G query heads of a KV head into one query axis, so
        # each KV head's history is one key set for G*n queries (10 % faster than broadcasting it)
        h = partial_attention(qc.reshape(1, hkv, g * n, d), kh.unsqueeze(0), vh.unsqueeze(0), scale=scale)
        parts.insert(0, Partial(h.out.view(hkv, g, n, d), h.lse.view(hkv, g, n)))
    out, lse = merge_partials(parts)
    return Partial(out.permute(2, 0, 1, 3), lse.permute(2, 0, 1))


def _all(t: int, device: torch.device) -> torch.Tensor:
    return torch.arange(t, device=device)
