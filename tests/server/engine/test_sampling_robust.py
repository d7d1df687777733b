"""The sampler is total: degenerate rows and extreme parameters give the documented token, never
an exception (one raised here once killed the engine thread and wedged the server)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine.sampling import LOGPROB_FLOOR, SamplingParams, greedy_ids, sample

NAN, INF = float("nan"), float("inf")
VOCAB = 50


def row(seed: int = 0) -> torch.Tensor:
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed))


def draw(lg: torch.Tensor, p: SamplingParams, n: int = 50) -> list[int]:
    g = p.generator()
    return [sample(lg, [p], [g])[0].token_id for _ in range(n)]


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46, 1e-9])
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(top_p: float):
    lg = row(1)
    # on the old sampler 1e-300 dropped every token and torch.multinomial raised
    assert set(draw(lg, SamplingParams(temperature=1.0, top_p=top_p, seed=3))) == {int(lg.argmax())}


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40])
def test_a_temperature_whose_scaling_overflows_falls_back_to_the_argmax(temperature: float):
    lg = row(2) * 30  # logits of +-100: divided by 1e-40 they overflow float32
    assert not torch.isfinite(torch.softmax(lg[0] / temperature, -1)).all()  # the case exists
    assert set(draw(lg, SamplingParams(temperature=temperature, seed=5))) == {int(lg.argmax())}


def test_a_huge_temperature_still_samples_the_whole_vocabulary():
    got = draw(row(3), SamplingParams(temperature=1e30, seed=7), 400)
    assert len(set(got)) > VOCAB // 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_are_never_chosen(temperature: float):
    lg = row(4)
    lg[0, 11] = 50.0
    lg[0, ::2] = NAN  # torch.argmax alone would pick a NaN
    assert int(lg.argmax()) % 2 == 0
    got = draw(lg, SamplingParams(temperature=temperature, seed=1))
    assert all(t % 2 == 1 for t in got)
    if temperature == 0.0:
        assert set(got) == {11}


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_an_inf_logit_is_a_point_mass_on_the_first_one(temperature: float):
    lg = row(5)
    lg[0, 7] = INF
    lg[0, 30] = INF
    lg[0, 3] = NAN
    p = SamplingParams(temperature=temperature, seed=2, logprobs=3, top_k=5, top_p=0.5)
    outs = [sample(lg, [p], [p.generator()])[0] for _ in range(20)]
    assert {o.token_id for o in outs} == {7}
    assert outs[0].logprob == 0.0
    assert outs[0].top_logprobs[0] == (7, 0.0)
    assert all(v == LOGPROB_FLOOR for _, v in outs[0].top_logprobs[1:])


@pytest.mark.parametrize("fill", [NAN, -INF])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_no_finite_logit_gives_token_0_with_finite_logprobs(fill: float, temperature: float):
    lg = torch.full((1, VOCAB), fill)
    p = SamplingParams(temperature=temperature, seed=0, logprobs=2, top_k=4, top_p=0.3)
    out = sample(lg, [p], [p.generator()])[0]
    assert out.token_id == 0
    assert out.logprob == LOGPROB_FLOOR and all(math.isfinite(v) for _, v in out.top_logprobs)


def test_minus_inf_logits_are_never_drawn_even_when_top_k_reaches_past_them():
    lg = torch.full((1, VOCAB), -INF)
    lg[0, [4, 9, 13]] = torch.tensor([0.0, 0.5, 1.0])
    assert set(draw(lg, SamplingParams(temperature=2.0, top_k=10, seed=4), 300)) == {4, 9, 13}


def test_a_degenerate_row_leaves_the_other_rows_of_its_batch_alone():
    good = SamplingParams(temperature=0.9, seed=99)
    alone = draw(row(6), good, 30)
    bad = SamplingParams(temperature=1.0, top_p=1e-300, seed=1)
    gens = [good.generator(), bad.generator(), None]
    batched = []
    for _ in range(30):
        lg = torch.cat([row(6), torch.full((1, VOCAB), NAN), torch.full((1, VOCAB), INF)])
        out = sample(lg, [good, bad, SamplingParams(temperature=0)], gens)
        batched.append(out[0].token_id)
        assert [o.token_id for o in out[1:]] == [0, 0]
    assert batched == alone


@st.composite
def rows(draw: st.DrawFn) -> torch.Tensor:
    values = st.one_of(st.floats(-1e6, 1e6, width=32), st.sampled_from([NAN, INF, -INF, 0.0, 3.4e38, -3.4e38]))
    return torch.tensor([draw(st.lists(values, min_size=2, max_size=12))], dtype=torch.float32)


@settings(max_examples=300, deadline=None)
@given(lg=rows(), temperature=st.one_of(st.just(0.0), st.floats(5e-324, 1e300)),
       top_p=st.floats(5e-324, 1.0, exclude_min=False), top_k=st.integers(0, 16), seed=st.integers(0, 2**63))
def test_any_row_and_any_valid_parameters_give_a_documented_token(lg, temperature, top_p, top_k, seed):
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, logprobs=2)
    out = sample(lg, [p], [p.generator()])[0]
    r = lg[0]
    assert 0 <= out.token_id < r.numel()
    assert math.isfinite(out.logprob) and all(math.isfinite(v) for _, v in out.top_logprobs)
    if torch.isposinf(r).any():
        assert out.token_id == int(torch.isposinf(r).to(torch.int8).argmax())
    elif torch.isfinite(r).any():
        assert torch.isfinite(r[out.token_id])  # never a NaN or -inf token while a finite one exists
    else:
        assert out.token_id == 0


@settings(max_examples=300, deadline=None)
@given(lg=rows(), temperature=st.one_of(st.just(0.0), st.floats(5e-324, 1e300)),
       repetition=st.one_of(st.just(1.0), st.floats(5e-324, 1e300)), frequency=st.floats(-2.0, 2.0),
       presence=st.floats(-2.0, 2.0), prompt=st.lists(st.integers(-3, 15), max_size=8),
       output=st.lists(st.integers(-3, 15), max_size=8), seed=st.integers(0, 2**63))
def test_any_row_and_any_valid_penalties_give_a_documented_token_and_the_raw_logprobs(
        lg, temperature, repetition, frequency, presence, prompt, output, seed):
    p = SamplingParams(temperature=temperature, seed=seed, logprobs=2, repetition_penalty=repetition,
                       frequency_penalty=frequency, presence_penalty=presence)
    out = sample(lg, [p], [p.generator()], tokens=[(prompt, output)])[0]
    raw = sample(lg, [SamplingParams(temperature=0, logprobs=2)], [None])[0]
    r = lg[0]
    assert 0 <= out.token_id < r.numel()
    assert out.top_logprobs == raw.top_logprobs  # penalties never touch the reported logprobs
    assert math.isfinite(out.logprob)
    if torch.isposinf(r).any():  # a point mass stays one
        assert out.token_id == int(torch.isposinf(r).to(torch.int8).argmax())
    elif torch.isfinite(r).any():
        assert torch.isfinite(r[out.token_id])  # a penalty never makes a NaN or -inf token win
    else:
        assert out.token_id == 0


_SPECIAL = st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, 1e30, -1e30])


@settings(max_examples=200, deadline=None)
@given(width=st.integers(1, 12), data=st.data(), bf16=st.booleans())
def test_greedy_ids_are_the_tokens_sample_picks_each_row_alone_or_minus_one_for_a_nan_row(width, data, bf16):
    """The batched greedy choice (the runner's, on the device) against the per-row sampler, on
    rows with NaN, +-inf, ties and huge values, in fp32 and bf16."""
    value = st.one_of(st.floats(-50, 50), st.integers(-3, 3).map(float), _SPECIAL)  # small ints: ties
    rows = data.draw(st.lists(st.lists(value, min_size=width, max_size=width), min_size=1, max_size=6))
    logits = torch.tensor(rows, dtype=torch.bfloat16 if bf16 else torch.float32)
    ids = greedy_ids(logits).tolist()
    for i, row in enumerate(logits):
        alone = sample(row[None], [SamplingParams(temperature=0)], [None])[0].token_id
        if bool(row.isnan().any()):
            assert ids[i] == -1  # a NaN row goes through sample, which reads NaN as -inf
        else:
            assert ids[i] == alone, (row, ids[i], alone)
