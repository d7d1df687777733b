"""The engine's own forward for the Llama family, over KV blocks it reads and writes in place.

The model math lives here; attention is delegated to ``cascade``, every matmul to a
``Projection`` (the LoRA seam) and the elementwise regions (norms, RoPE, SiLU·up) to a
``Regions`` (``elementwise``: torch's ops; ``vllm_elementwise``: vLLM's). One call runs one
step (:class:`~server.engine.batch.StepPlan`): any mix of chunked-prefill chunks and
single-token decodes, with or without shared prefixes::

    ids ─ embed ─┬─[ layer 0 .. L-1: norm · qkv · RoPE · write K/V to slots · cascade · o ·
                 │                    norm · gate_up · SiLU · down ]─ norm ─ lm_head(logit rows)
                 └ positions, slots, prefix groups: from the plan, computed once per step

>>> import torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> from server.engine.batch import Chunk, plan_step
>>> from server.kv.storage import KVStorage
>>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
...                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)
>>> fwd = LlamaForward.from_hf(LlamaForCausalLM(cfg))
>>> kv = KVStorage(fwd.kv_spec(), num_blocks=4, block_size=16)
>>> plan = plan_step([Chunk([1, 2, 3], start=0, slots=torch.arange(3))], block_size=16)
>>> fwd(plan, kv).shape                                  # logits of the last token
torch.Size([1, 64])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.nn.functional as F

from server.engine import vllm_elementwise
from server.engine.batch import StepPlan
from server.engine.cascade import cascade_attention
from server.engine.elementwise import (
    FUSED_MIN_ROWS,
    FusedSlot,
    Regions,
    TorchRegions,
    eager_regions,
    rms_norm,
)
from server.engine.projection import BaseProjection, Projection
from server.engine.rope import Rope, apply_rope
from server.engine.weights import LayerWeights, ModelWeights
from server.kv.storage import KVSpec, KVStorage


@dataclass(frozen=True, slots=True)
class Join:
    """Rows that enter a step at ``layer`` from their ``hidden`` state there [n, hidden_size],
    after the rows already running; ``plan`` lays out the step from that layer on."""

    layer: int
    hidden: torch.Tensor
    plan: StepPlan


@dataclass(frozen=True, slots=True)
class LlamaForward:
    weights: ModelWeights
    rope: Rope
    projection: Projection = field(default_factory=BaseProjection)
    fused: FusedSlot = field(default_factory=FusedSlot, compare=False, repr=False)
    """Fused elementwise kernels for prefill-sized steps, once built (``elementwise``)."""
    small: Regions | None = field(default=None, compare=False, repr=False)
    """The elementwise regions of steps the fused kernels do not take (below ``FUSED_MIN_ROWS`` rows,
    or before they are built) when not eager: vLLM's ops where they serve these weights
    (``vllm_elementwise``), set at construction."""

    def __post_init__(self) -> None:
        if self.small is None and vllm_elementwise.serves(self.weights):
            object.__setattr__(self, "small", vllm_elementwise.VllmRegions(self.weights, self.rope))

    def regions(self, rows: int) -> Regions:
        """The elementwise kernels of a step of ``rows`` rows: the fused ones from
        ``FUSED_MIN_ROWS`` rows once loaded, else :attr:`small` where set, else eager."""
        if rows >= FUSED_MIN_ROWS:
            kernels = self.fused.get()
            if kernels is not None:
                return TorchRegions(kernels, fused=True)
        return self.small or eager_regions(self.weights.shape.rms_norm_eps)

    @classmethod
    def from_hf(
        cls, model: torch.nn.Module, *, dtype: torch.dtype | None = None, pack: bool | None = None,
        device: torch.device | str | None = None,
    ) -> LlamaForward:
        """From a transformers ``*ForCausalLM`` (config and weights on ``device``; ``pack``: see
        :meth:`ModelWeights.from_hf`)."""
        weights = ModelWeights.from_hf(model, dtype=dtype, pack=pack, device=device)
        return cls(weights, Rope.from_config(model.config, weights.shape.head_dim))

    def kv_spec(self) -> KVSpec:
        s = self.weights.shape
        return KVSpec(s.num_layers, s.num_kv_heads, s.head_dim, self.weights.dtype)

    def check_positions(self, plan: StepPlan) -> None:
        """Refuse a step whose last position lies past the model's context (read on the host)."""
        limit = self.weights.shape.max_context
        if plan.max_position >= limit:
            raise ValueError(f"position {plan.max_position} beyond the context of {limit}")

    @torch.inference_mode()
    def __call__(
        self, plan: StepPlan, kv: KVStorage, *, projection: Projection | None = None,
        first_layer: int = 0, hidden: torch.Tensor | None = None, joins: Sequence[Join] = (),
    ) -> torch.Tensor:
        """Run one step: writes the step's K/V into ``kv``; returns logits [rows, vocab] (fp32
        if the weights are fp32, else their dtype) for the last plan's ``logit_rows``.

        ``projection`` overrides the forward's own for this step (e.g. a per-row LoRA one).
        ``first_layer`` / ``hidden``: start at that layer from these input rows [T, hidden]
        instead of from the tokens (a layer-split module recomputing its top layers from the
        base's hidden state); the K/V of the layers below are not touched. ``joins``: rows that
        enter later, each at its layer (ascending, above ``first_layer``) from its own hidden
        state, appended after the rows running so far; from there on the step follows the
        join's plan (its rows: the earlier ones, then the joined ones). The input of every layer
        in ``kv.hidden`` is kept at the step's slots.
        """
        w, s = self.weights, self.weights.shape
        if kv.spec != self.kv_spec():
            raise ValueError(f"KV storage {kv.spec} does not fit this model ({self.kv_spec()})")
        if (first_layer > 0) != (hidden is not None) or not 0 <= first_layer < s.num_layers:
            raise ValueError(f"start at layer {first_layer} of {s.num_layers} needs that layer's input, and only then")
        layers = [first_layer, *(j.layer for j in joins)]
        if any(a >= b for a, b in pairwise(layers)) or layers[-1] >= s.num_layers:
            raise ValueError(f"rows join at layers {layers[1:]}: each above the last, below {s.num_layers}")
        for p in (plan, *(j.plan for j in joins)):
            self.check_positions(p)
        project = projection or self.projection
        regions = self.regions(len(plan.token_ids if hidden is None else hidden))
        tables = regions.tables(self.rope, plan.positions, w.dtype)
        # a copy of given rows: the regions may write into the residual stream
        h = F.embedding(plan.token_ids, w.embed) if hidden is None else hidden.to(w.dtype, copy=True)
        pending = list(joins)
        for i in range(first_layer, s.num_layers):
            if pending and pending[0].layer == i:
                join = pending.pop(0)
                plan, h = join.plan, torch.cat([h, join.hidden.to(w.dtype)])
                tables = regions.tables(self.rope, plan.positions, w.dtype)
            keep = kv.hidden.get(i)
            if keep is not None:
                keep.index_copy_(0, plan.write_slots, h)
            h = self._layer(i, w.layers[i], h, tables, plan, kv, project, regions)
        if plan.logit_rows is not None:
            h = h.index_select(0, plan.logit_rows)
        h = rms_norm(h, w.final_norm, s.rms_norm_eps)
        return project(h, w.lm_head, layer=-1, name="lm_head")

    def _layer(
        self,
        index: int,
        layer: LayerWeights,
        h: torch.Tensor,
        tables: tuple[torch.Tensor, ...],
        plan: StepPlan,
        kv: KVStorage,
        project: Projection,
        regions: Regions,
    ) -> torch.Tensor:
        s = self.weights.shape
        t = h.shape[0]
        x = regions.rms_norm(h, layer.input_norm)
        qkv = project(x, layer.qkv, layer=index, name="qkv")
        v = qkv[:, s.q_size + s.kv_size :].view(t, s.num_kv_heads, s.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:  # qwen3 (torch's regions: cos, sin tables)
            cos, sin = tables
            q, k, _ = qkv.split((s.q_size, s.kv_size, s.kv_size), dim=-1)
            q = rms_norm(q.view(t, s.num_heads, s.head_dim), layer.q_norm, s.rms_norm_eps)
            k = rms_norm(k.view(t, s.num_kv_heads, s.head_dim), layer.k_norm, s.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # q and k sit side by side in qkv's output: rotate both heads in one pass
            qk = regions.rope(qkv, s.num_heads + s.num_kv_heads, tables)
            q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
        k_cache, v_cache = kv.k[index], kv.v[index]
        if not plan.attention_writes_kv:
            k_cache.index_copy_(1, plan.write_slots, k.transpose(0, 1))
            v_cache.index_copy_(1, plan.write_slots, v.transpose(0, 1))
        attn = cascade_attention(
            q.view(t, s.num_kv_heads, s.group_size, s.head_dim),
            k,
            v,
            k_cache,
            v_cache,
            plan,
            scale=1.0 / math.sqrt(s.head_dim),
        )
        o = project(attn.reshape(t, s.q_size), layer.o, layer=index, name="o")
        h, x = regions.add_rms_norm(h, o, layer.post_norm)
        gate_up = project(x, layer.gate_up, layer=index, name="gate_up")
        return h + project(regions.silu_mul(gate_up), layer.down, layer=index, name="down")
