"""The split forward of docs/design.md §2 in transformers: the base computes positions < IP, the module the rest.

This is the reference path for training and evaluating decode modules:

- :meth:`SplitModel.prefix` runs the frozen base over the prefix columns without gradients —
  exactly the KV a server shares;
- :meth:`SplitModel.loss` continues with the trainable module from that cache over the suffix
  (cache-conditioned fine-tuning), loss on the response tokens only;
- :meth:`SplitModel.generate` decodes greedily the same way (or, with ``split=False`` batches,
  from the module's own prefill).

A LoRA module needs no second copy of the base: its prefix runs with the adapters disabled.
A ``full`` module is paired with a frozen copy of the base.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, cast

import torch
from torch import nn
from transformers import DynamicCache

from server.training.dataset import Batch

# a transformers *ForCausalLM: its submodules (.model, .lm_head, .model.layers) are attributes that
# nn.Module types as Tensor | Module, so it is used untyped
CausalLM = Any


def _causal_lm(model: nn.Module) -> CausalLM:
    """The transformers *ForCausalLM under a peft wrapper (LoRA layers injected), or the model."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


class SplitModel:
    """A decode module and the frozen base it shares a prefill with.

    ``base`` is a separate frozen model (full modules), or None: then the base is the module
    with its peft adapters disabled (LoRA), or the module itself (a plain model = the base).
    ``autocast``: run matmuls in bfloat16 (autocast on the module's device) for speed; fp32 when False.
    """

    def __init__(self, module: nn.Module, base: nn.Module | None = None, *, autocast: bool = False,
                 recompute: int = 0) -> None:
        self.module = module
        self.base = base
        self.autocast = autocast
        self.recompute = recompute  # top layers whose prefix KV the module recomputes (0: none)
        if base is not None:
            base.requires_grad_(False).eval()

    def _amp(self) -> Any:
        device = next(self.module.parameters()).device.type
        return torch.autocast(device, dtype=torch.bfloat16) if self.autocast else nullcontext()

    @contextmanager
    def _base_model(self) -> Iterator[CausalLM]:
        if self.base is not None:
            yield _causal_lm(self.base)
        elif hasattr(self.module, "disable_adapter"):
            with cast(Any, self.module).disable_adapter():  # a peft model
                yield _causal_lm(self.module)
        else:
            yield _causal_lm(self.module)

    def prefix(self, batch: Batch) -> DynamicCache:
        """KV of the prefix columns, computed by the base (no gradients).

        With ``recompute = k > 0`` the module recomputes the prefix KV of the top k layers from
        the base's hidden state at that depth (DroidSpeak-style partial recompute; with
        gradients while the module trains); ``k`` = all layers is a private prefill.
        """
        cache = DynamicCache()
        P = batch.prefix_len
        if P == 0:
            return cache
        cols = {"attention_mask": batch.attention_mask[:, :P], "position_ids": batch.position_ids[:, :P]}
        k = self.recompute
        with torch.no_grad(), self._base_model() as lm, self._amp():
            out = lm.model(input_ids=batch.input_ids[:, :P], past_key_values=cache, use_cache=True,
                           output_hidden_states=k > 0, **cols)
        if k > 0:
            mlm = _causal_lm(self.module).model
            layers = mlm.layers
            start = len(layers) - min(k, len(layers))
            top = DynamicCache()
            mlm.layers = nn.ModuleList(list(layers)[start:])  # each keeps its own layer_idx
            try:
                with torch.set_grad_enabled(self.module.training), self._amp():
                    mlm(inputs_embeds=out.hidden_states[start], past_key_values=top, use_cache=True, **cols)
            finally:
                mlm.layers = layers
            cache.layers[start:] = top.layers[start:]
        return cache

    def suffix_hidden(self, batch: Batch, cache: DynamicCache) -> torch.Tensor:
        """Hidden states of the suffix columns computed by the module, continuing ``cache``."""
        P = batch.prefix_len
        lm = _causal_lm(self.module)
        with self._amp():
            out = lm.model(input_ids=batch.input_ids[:, P:], attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids[:, P:], past_key_values=cache, use_cache=True)
        return out.last_hidden_state

    def loss(self, batch: Batch) -> torch.Tensor:
        """Mean cross-entropy over the response tokens, module continuing from the base's prefix KV."""
        h = self.suffix_hidden(batch, self.prefix(batch))
        sel = batch.labels != -100
        with self._amp():
            logits = _causal_lm(self.module).lm_head(h[sel])
        return nn.functional.cross_entropy(logits.float(), batch.labels[sel])

    @torch.no_grad()
    def kv(self, batch: Batch) -> DynamicCache:
        """The KV of every column as a server computes it (base < IP, module >= IP)."""
        cache = self.prefix(batch)
        self.suffix_hidden(batch, cache)
        return cache

    @torch.no_grad()
    def generate(self, batch: Batch, *, max_new_tokens: int, eos_id: int,
                 cache: DynamicCache | None = None) -> list[list[int]]:
        """Greedy continuation of every row (the batch holds prompts only, no responses).

        ``cache``: the prefix KV if already computed by the base (it is extended in place).
        """
        cache = self.prefix(batch) if cache is None else cache
        h = self.suffix_hidden(batch, cache)[:, -1]
        lm = _causal_lm(self.module)
        mask, pos = batch.attention_mask, batch.position_ids[:, -1:]
        B = h.shape[0]
        out: list[list[int]] = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        for _ in range(max_new_tokens):
            with self._amp():
                nxt = lm.lm_head(h).float().argmax(-1)
            for r in range(B):
                if not done[r]:
                    out[r].append(int(nxt[r]))
            done |= nxt == eos_id
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype)], dim=1)
            pos = pos + 1
            with self._amp():
                h = lm.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                             past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
        return [[t for t in seq if t != eos_id] for seq in out]
