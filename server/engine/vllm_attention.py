"""Decode attention of a few requests through the vllm package's CPU kernel, where it is installed.

The cascade (:mod:`server.engine.cascade`) reads a shared prefix once for every request of a
step, through torch's flash kernel. That kernel is slow on decode-sized queries: for one request
over a 2,048-token prefix (bf16, 2 threads, the default model's 3 KV heads of 3 query heads each)
the prefix partial, the request's own partial and their merge took 176 µs a layer. vLLM's CPU
build carries a decode kernel (``_C::decode_attention_cpu``, from SGLang) that reads each
request's whole sequence through a table of slots: 58 µs for that request, 156–182 µs for 3
(against 205–239), but 779 µs for 16, where reading the prefix once wins (497 µs). So a step of
single-token requests, at most :data:`MAX_ROWS` of them, attends each request's whole sequence
(its shared prefix, then its own slots) in one call of that kernel; larger steps keep the
cascade. The result is the same attention, computed with fp32 accumulators and rounded once.

It serves bf16 steps on the CPU where the ``vllm`` extra is installed (the library is loaded as
for :mod:`server.engine.vllm_matmul`); ``AGENTSHARE_VLLM_ATTENTION=off`` turns it off.
:func:`status` says which case holds, for the server's start-up log.

>>> status() == "on" or status().startswith("off")
True
"""

from __future__ import annotations

import functools
import math

import torch

from server.engine import vllm_matmul
from server.engine.batch import WholeSequences

MAX_ROWS = 3
"""The most single-token requests a step attends through this kernel. Decode steps over a shared
2,048-token prefix (the default model, bf16, 2 threads) took 0.79x the cascade's time with 1
request, 0.94x with 3 and 1.01x with 4 (medians of 6 alternating pairs of 32 steps)."""

_SCHEMA = (
    "_C::decode_attention_cpu(Tensor query, Tensor k_buffer, Tensor v_buffer, Tensor(a!) output, "
    "Tensor? key, Tensor? value, Tensor? loc, Tensor attn_logits, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
    "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
)


@functools.cache
def status() -> str:
    """``"on"``, or why decode steps keep the cascade."""
    return vllm_matmul.op_status("decode_attention_cpu", _SCHEMA, "AGENTSHARE_VLLM_ATTENTION")


def serves(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True if decode steps of this dtype on this device go through the kernel."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and status() == "on"


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: WholeSequences,
           scale: float | None = None) -> torch.Tensor:
    """Attention output [R, Hkv, G, D] of one query row per request ``q`` [R, Hkv, G, D] over each
    request's whole sequence in ``k_cache``/``v_cache`` [Hkv, slots, D] (bf16)."""
    rows, hkv, g, d = q.shape
    heads = q.reshape(rows, hkv * g, d)  # KV head-major, as the kernel groups query heads
    out = torch.empty_like(heads)
    # split each sequence's keys in two where there are fewer (request, KV head) pairs than two per
    # thread: one request over 2,048 keys took 58 µs so against 72 µs unsplit (2 threads)
    splits = 1 if rows * hkv >= 2 * torch.get_num_threads() else 2
    partials = torch.empty(rows, hkv * g, splits, d + 1, dtype=torch.float32)
    torch.ops._C.decode_attention_cpu(
        heads, k_cache.transpose(0, 1), v_cache.transpose(0, 1), out, None, None, seqs.loc, partials,
        seqs.table, seqs.requests, seqs.lengths, 1.0 / math.sqrt(d) if scale is None else scale, 0.0, False,
        -1, None, None)
    return out.view(rows, hkv, g, d)
