"""Attention through the vllm package's CPU kernels (from SGLang), where it is installed.

The cascade (:mod:`server.engine.cascade`) reads a shared prefix once for every request of a
step, through torch's flash kernel, and gathers each request's own slots into a padded, masked
batch. vLLM's CPU build carries two kernels that read each request's whole sequence through a
table of slots instead, with fp32 accumulators and one rounding of the output:

* ``_C::decode_attention_cpu`` for a step of single-token requests. One request over a
  2,048-token shared prefix (bf16, 2 threads, the default model's 3 KV heads of 3 query heads)
  took 58 µs a layer against the cascade's 176 µs; 3 requests 156–182 µs against 205–239; but
  16 requests 779 µs against 497, where reading the prefix once wins. Over private histories
  (no shared prefix) it wins at every size: 3 requests of 2,048 tokens each 365 µs against
  1,169 (the cascade copies every history to gather it).
* ``_C::extend_attention_cpu`` for a step with chunks of several tokens and no shared prefix:
  each chunk over its history and, causally, itself. A 2,048-token prompt took 14.0 ms a layer
  against 16.7; 512 tokens 1.1 against 1.4 ms.

So ``plan_step`` lays out each request's whole sequence (``WholeSequences``) for a step that
reads no shared prefix, or holds at most :data:`MAX_ROWS` single-token requests; the cascade
hands such a step to :func:`attend`. Steps that share a prefix among more requests, or mix a
chunk with a shared prefix, keep the cascade.

It serves bf16 steps on the CPU where the ``vllm`` extra is installed (the library is loaded
by :mod:`server.engine.vllm_ops`); ``AGENTSHARE_VLLM_ATTENTION=off`` turns it off.
:func:`status` says which case holds, for the server's start-up log.

>>> status() == "on" or status().startswith("off")
True
"""

from __future__ import annotations

import functools
import math

import torch

from server.engine import vllm_ops
from server.engine.batch import WholeSequences

MAX_ROWS = 3
"""The most single-token requests over a shared prefix a step attends through the decode kernel.
Decode steps over a shared 2,048-token prefix (the default model, bf16, 2 threads) took 0.79x
the cascade's time with 1 request, 0.94x with 3 and 1.01x with 4 (medians of 6 alternating
pairs of 32 steps)."""

_SCHEMA = (
    "_C::decode_attention_cpu(Tensor query, Tensor k_buffer, Tensor v_buffer, Tensor(a!) output, "
    "Tensor? key, Tensor? value, Tensor? loc, Tensor attn_logits, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
    "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
)


_EXTEND_SCHEMA = (
    "_C::extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
    "Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
    "Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, float sm_scale, float logit_cap, "
    "bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask=None) -> ()"
)


@functools.cache
def status() -> str:
    """``"on"``, or why every step keeps the cascade."""
    decode = vllm_ops.op_status("decode_attention_cpu", _SCHEMA, "AGENTSHARE_VLLM_ATTENTION")
    return decode if decode != "on" else vllm_ops.op_status(
        "extend_attention_cpu", _EXTEND_SCHEMA, "AGENTSHARE_VLLM_ATTENTION")


def attend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, seqs: WholeSequences, scale: float | None = None) -> torch.Tensor:
    """Attention output [T, Hkv, G, D] of the step's queries ``q`` [T, Hkv, G, D], each request's
    rows over its whole sequence: :func:`decode` for a step of single-token requests, else
    :func:`extend` (``k_new``/``v_new`` [T, Hkv, D]: the step's keys and values)."""
    if seqs.decode_only:  # the kernel writes the new K/V at ``seqs.loc`` (StepPlan.attention_writes_kv)
        return decode(q, k_cache, v_cache, seqs, scale, k_new, v_new)
    return extend(q, k_new, v_new, k_cache, v_cache, seqs, scale)


def extend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, seqs: WholeSequences, scale: float | None = None) -> torch.Tensor:
    """Each request's new rows of ``q`` [T, Hkv, G, D] over its earlier slots in the cache and,
    causally, its new keys ``k_new``/``v_new`` [T, Hkv, D] (bf16): ``_C::extend_attention_cpu``."""
    t, hkv, g, d = q.shape
    out = torch.empty(t, hkv * g, d, dtype=q.dtype)
    torch.ops._C.extend_attention_cpu(
        q.reshape(t, hkv * g, d), k_new, v_new, out, k_cache.transpose(0, 1), v_cache.transpose(0, 1), seqs.table,
        seqs.requests, seqs.lengths, seqs.new, seqs.starts, seqs.max_new,
        1.0 / math.sqrt(d) if scale is None else scale, 0.0, False, -1, None, None, None)
    return out.view(t, hkv, g, d)


HEAD_DIM_MULTIPLE = 32
"""The kernels take heads whose size is a multiple of 32 (they transpose by 512-bit rows) and
refuse others at the first call ("invalid head_size")."""


def serves(dtype: torch.dtype, device: torch.device | str, head_dim: int) -> bool:
    """True if decode steps of this dtype on this device, with heads of ``head_dim``, go through
    the kernel."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and head_dim % HEAD_DIM_MULTIPLE == 0
            and status() == "on")


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: WholeSequences,
           scale: float | None = None, k_new: torch.Tensor | None = None,
           v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output [R, Hkv, G, D] of one query row per request ``q`` [R, Hkv, G, D] over each
    request's whole sequence in ``k_cache``/``v_cache`` [Hkv, slots, D] (bf16). With ``k_new``/``v_new``
    [R, Hkv, D] the kernel first writes them at each request's last slot (``seqs.loc``), as the
    forward's copy would; without them they must be there already."""
    rows, hkv, g, d = q.shape
    heads = q.reshape(rows, hkv * g, d)  # KV head-major, as the kernel groups query heads
    out = torch.empty_like(heads)
    # split each sequence's keys in two where there are fewer (request, KV head) pairs than two per
    # thread: one request over 2,048 keys took 58 µs so against 72 µs unsplit (2 threads)
    splits = 1 if rows * hkv >= 2 * torch.get_num_threads() else 2
    partials = torch.empty(rows, hkv * g, splits, d + 1, dtype=torch.float32)
    torch.ops._C.decode_attention_cpu(
        heads, k_cache.transpose(0, 1), v_cache.transpose(0, 1), out, k_new, v_new, seqs.loc, partials,
        seqs.table, seqs.requests, seqs.lengths, 1.0 / math.sqrt(d) if scale is None else scale, 0.0, False,
        -1, None, None)
    return out.view(rows, hkv, g, d)
