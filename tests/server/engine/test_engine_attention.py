"""Attention partials and their LSE merge vs plain softmax attention over concatenated keys."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine.attention import Partial, merge_partials, partial_attention, reference_partial
from server.engine.batch import Chunk, SharedPrefix, plan_step
from server.engine.cascade import cascade_attention


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.double()).float()


@settings(max_examples=40, deadline=None)
@given(
    splits=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    lq=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_merge_of_partials_equals_attention_over_the_union(splits: list[int], lq: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    total = sum(splits)
    q = torch.randn(2, 3, lq, 64, generator=g) * 2
    k = torch.randn(2, 3, total, 64, generator=g) * 2
    v = torch.randn(2, 3, total, 64, generator=g)
    parts, pos = [], 0
    for n in splits:
        parts.append(partial_attention(q, k[..., pos : pos + n, :], v[..., pos : pos + n, :]))
        pos += n
    out, lse = merge_partials(parts)
    torch.testing.assert_close(out, _plain(q, k, v), atol=1e-5, rtol=1e-5)
    scores = q.double() @ k.double().transpose(-1, -2) / 8
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-4, rtol=1e-5)


def test_a_fully_masked_partial_contributes_nothing() -> None:
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    real = reference_partial(q, k, v)
    empty = Partial(torch.zeros_like(real.out), torch.full_like(real.lse, float("-inf")))
    for parts in ([empty, real], [real, empty], [empty, empty, real]):  # the two-part form and the general one
        out, lse = merge_partials(parts)
        torch.testing.assert_close(out, real.out)
        torch.testing.assert_close(lse, real.lse)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_reference(causal: bool, dtype: torch.dtype) -> None:
    q, k, v = (torch.randn(2, 3, 7, 64).to(dtype) for _ in range(3))
    mask = torch.zeros(2, 1, 7, 7).masked_fill(torch.rand(2, 1, 7, 7) < 0.3, float("-inf"))
    mask[..., 0] = 0.0
    for m in (None, mask):
        got = partial_attention(q, k, v, causal=causal, mask=m)
        ref = reference_partial(q, k, v, causal=causal, mask=m)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.out.float(), ref.out.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(got.lse, ref.lse, atol=tol, rtol=tol)


def test_cascade_attention_of_a_mixed_step_equals_plain_attention() -> None:
    """GQA queries of a step (2 decodes on a shared prefix, 1 chunk on it, 1 decode without a
    prefix) vs softmax over each request's concatenated [prefix | own] keys with a causal mask."""
    hkv, g, d, block = 2, 3, 64, 4
    k_cache, v_cache = torch.randn(hkv, 40 * block, d), torch.randn(hkv, 40 * block, d)
    prefix = SharedPrefix(first_block=1, num_tokens=10)  # slots 4..13
    chunks = [
        Chunk([1], start=12, slots=torch.tensor([100, 101, 60]), prefix=prefix),
        Chunk([1, 2, 3, 4], start=14, slots=torch.tensor([80, 81, 82, 83, 120, 121, 122, 123]),
              prefix=prefix),
        Chunk([1], start=4, slots=torch.tensor([30, 31, 32, 37, 77])),  # no prefix
        Chunk([1], start=10, slots=torch.tensor([140]), prefix=prefix),
    ]
    plan = plan_step(chunks, block_size=block, all_logits=True)
    t = plan.num_tokens
    q = torch.randn(t, hkv, g, d)
    k_new, v_new = torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    k_cache[:, plan.write_slots] = k_new.transpose(0, 1)
    v_cache[:, plan.write_slots] = v_new.transpose(0, 1)
    got = cascade_attention(q, k_new, v_new, k_cache, v_cache, plan)

    for c, (lo, hi) in zip(chunks, plan.row_spans, strict=True):
        pre = torch.arange(4, 4 + c.prefix_len)
        keys = torch.cat([pre, c.slots])
        kk, vv = k_cache[:, keys], v_cache[:, keys]  # [Hkv, L, D]
        qq = q[lo:hi].permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        n, length = hi - lo, keys.numel()
        keep = torch.ones(n, length, dtype=torch.bool).tril(length - n)
        want = _plain(qq, kk[:, None], vv[:, None], keep).permute(2, 0, 1, 3)
        torch.testing.assert_close(got[lo:hi], want, atol=1e-5, rtol=1e-5)


def test_a_step_of_few_single_token_requests_carries_their_whole_sequences_when_asked() -> None:
    block = 4
    prefix = SharedPrefix(first_block=2, num_tokens=6)  # slots 8..13
    decodes = [Chunk([5], start=8, slots=torch.tensor([20, 21, 30]), prefix=prefix),
               Chunk([6], start=1, slots=torch.tensor([40, 41]))]
    plan = plan_step(decodes, block_size=block, whole_sequences=2)
    seqs = plan.sequences
    assert seqs is not None and seqs.decode_only and seqs.max_new == 1
    assert seqs.table.dtype == torch.int32 and seqs.lengths.tolist() == [9, 2]
    assert seqs.table.tolist() == [[8, 9, 10, 11, 12, 13, 20, 21, 30], [40, 41, 0, 0, 0, 0, 0, 0, 0]]
    assert seqs.requests.tolist() == [0, 1] and seqs.starts.tolist() == [0, 1]
    assert seqs.loc.tolist() == plan.write_slots.tolist() == [30, 41]  # where the decode kernel writes K/V
    assert plan.attention_writes_kv  # so the forward does not copy them first
    # not asked, or more single-token requests than asked for over a shared prefix: the cascade's plan only
    assert plan_step(decodes, block_size=block).sequences is None
    assert plan_step(decodes, block_size=block, whole_sequences=1).sequences is None
    # a chunk of several tokens beside a shared prefix: the cascade reads the prefix once
    mixed = [*decodes, Chunk([1, 2], start=0, slots=torch.tensor([50, 51]))]
    assert plan_step(mixed, block_size=block, whole_sequences=8).sequences is None


def test_a_step_that_reads_no_shared_prefix_carries_every_request_whole_when_asked() -> None:
    chunks = [Chunk([1, 2, 3], start=2, slots=torch.tensor([4, 5, 6, 7, 9])),  # history 4, 5; new 6, 7, 9
              Chunk([4], start=0, slots=torch.tensor([12])),
              Chunk([5, 6], start=0, slots=torch.tensor([16, 17]))]
    seqs = plan_step(chunks, block_size=4, whole_sequences=1).sequences
    assert seqs is not None and not seqs.decode_only and seqs.max_new == 3
    assert seqs.lengths.tolist() == [5, 1, 2] and seqs.new.tolist() == [3, 1, 2] and seqs.starts.tolist() == [0, 3, 4]
    assert seqs.new.dtype == seqs.starts.dtype == seqs.table.dtype == torch.int32
    assert seqs.table.tolist() == [[4, 5, 6, 7, 9], [12, 0, 0, 0, 0], [16, 17, 0, 0, 0]]
    assert plan_step(chunks, block_size=4).sequences is None
    assert not plan_step(chunks, block_size=4, whole_sequences=1).attention_writes_kv  # the extend kernel reads them
    assert not plan_step(chunks, block_size=4).attention_writes_kv


def test_long_contiguous_histories_of_decodes_are_read_as_views_with_the_same_attention() -> None:
    from server.engine.batch import VIEW_MIN_SLOTS

    torch.manual_seed(0)
    hkv, g, d = 2, 3, 16
    k_cache, v_cache = torch.randn(hkv, 2048, d), torch.randn(hkv, 2048, d)
    long = VIEW_MIN_SLOTS + 40
    chunks = [Chunk([1], start=long - 1, slots=torch.arange(100, 100 + long)),
              Chunk([2], start=9, slots=torch.arange(1000, 1010))]
    plan = plan_step(chunks, block_size=16)
    assert plan.decode is not None and plan.decode.spans == (slice(100, 100 + long), slice(1000, 1010))
    q = torch.randn(2, hkv, g, d)
    got = cascade_attention(q, torch.empty(0), torch.empty(0), k_cache, v_cache, plan)
    for r, c in enumerate(chunks):  # each request over its own slots, as plain attention
        k, v = k_cache[:, c.slots].unsqueeze(0), v_cache[:, c.slots].unsqueeze(0)
        torch.testing.assert_close(got[r], _plain(q[r].unsqueeze(0), k, v)[0], atol=1e-5, rtol=1e-5)
    # short histories, or one that is not contiguous: the padded gather
    assert plan_step(chunks[1:], block_size=16).decode.spans is None  # type: ignore[union-attr]
    gapped = [chunks[0], Chunk([2], start=2, slots=torch.tensor([1000, 1001, 1005]))]
    assert plan_step(gapped, block_size=16).decode.spans is None  # type: ignore[union-attr]
    assert plan_step(chunks, block_size=16, device="meta").decode.spans is None  # type: ignore[union-attr]
