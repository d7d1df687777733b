import pytest
import torch

from server.engine.errors import InvalidRequest
from server.engine.sampling import SamplingParams, sample

VOCAB = 50


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_takes_the_argmax():
    lg = logits(4)
    got = [s.token_id for s in sample(lg, [SamplingParams(temperature=0)] * 4, [None] * 4)]
    assert got == lg.argmax(-1).tolist()


def draws(params: SamplingParams, lg: torch.Tensor, n: int) -> list[int]:
    g = params.generator()
    return [sample(lg, [params], [g])[0].token_id for _ in range(n)]


def test_a_seed_gives_the_same_tokens_alone_and_in_any_batch():
    p = SamplingParams(temperature=0.9, seed=1234)
    lg = logits(1)
    alone = draws(p, lg, 30)
    others = [SamplingParams(temperature=1.3, seed=s) for s in range(3)]
    g, gens = p.generator(), [o.generator() for o in others]
    batched = []
    for step in range(30):
        batch = torch.cat([logits(1, seed=100 + step), lg, logits(2, seed=200 + step)])
        out = sample(batch, [others[0], p, others[1], others[2]], [gens[0], g, gens[1], gens[2]])
        batched.append(out[1].token_id)
    assert batched == alone
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_differ_and_no_seed_is_not_fixed():
    lg = logits(1)
    a = draws(SamplingParams(temperature=1.0, seed=1), lg, 20)
    b = draws(SamplingParams(temperature=1.0, seed=2), lg, 20)
    assert a != b
    assert draws(SamplingParams(temperature=1.0), lg, 20) != draws(SamplingParams(temperature=1.0), lg, 20)


def test_top_k_and_top_p_restrict_the_support():
    lg = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0, -10.0]])
    assert set(draws(SamplingParams(temperature=5.0, top_k=2, seed=0), lg, 200)) == {0, 1}
    # probabilities at temperature 1: ~0.665, 0.245, 0.09 -> top_p 0.8 keeps two tokens
    assert set(draws(SamplingParams(top_p=0.8, seed=0), lg, 300)) == {0, 1}
    assert set(draws(SamplingParams(top_p=0.5, seed=0), lg, 100)) == {0}


def test_sampling_follows_the_distribution():
    lg = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = torch.bincount(torch.tensor(draws(SamplingParams(seed=3), lg, 3000)), minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_logprobs_are_the_models_log_softmax():
    lg = logits(1)
    out = sample(lg, [SamplingParams(temperature=0, logprobs=3)], [None])[0]
    ref = torch.log_softmax(lg[0], -1)
    assert out.logprob == pytest.approx(float(ref.max()))
    assert [t for t, _ in out.top_logprobs] == torch.topk(ref, 3).indices.tolist()
    assert sample(lg, [SamplingParams(temperature=0)], [None])[0].logprob is None


def test_sampled_logprobs_are_the_raw_log_softmax_not_the_sampling_distribution():
    # At temperature > 0 with top-k and top-p, logprobs still describe the model's own
    # distribution (vLLM's default "raw logprobs"), not the scaled or truncated one.
    lg = logits(1, seed=5)
    ref = torch.log_softmax(lg[0], -1)
    p = SamplingParams(temperature=1.7, top_k=3, top_p=0.9, seed=11, logprobs=5)
    g = p.generator()
    for _ in range(20):
        out = sample(lg, [p], [g])[0]
        assert out.logprob == pytest.approx(float(ref[out.token_id]), abs=1e-6)
        assert [t for t, _ in out.top_logprobs] == torch.topk(ref, 5).indices.tolist()
        assert [v for _, v in out.top_logprobs] == pytest.approx(torch.topk(ref, 5).values.tolist(), abs=1e-6)


def test_logprobs_zero_reports_the_chosen_token_only_and_rows_choose_independently():
    lg = logits(2, seed=6)
    ref = torch.log_softmax(lg, -1)
    rows = sample(lg, [SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=0)], [None, None])
    assert [r.token_id for r in rows] == lg.argmax(-1).tolist()
    assert rows[0].logprob == pytest.approx(float(ref[0].max())) and rows[0].top_logprobs == []
    assert rows[1].logprob is None and rows[1].top_logprobs == []  # only the row that asked
    top = sample(lg[:1], [SamplingParams(temperature=0, logprobs=20)], [None])[0]
    assert top.token_id == int(lg[0].argmax()) and len(top.top_logprobs) == 20


def test_forced_tokens_are_taken_and_scored_and_others_still_sample():
    lg = logits(2, seed=7)
    ref = torch.log_softmax(lg, -1)
    forced_token = int(lg[0].argmin())
    p = SamplingParams(temperature=0, logprobs=1)
    rows = sample(lg, [p, p], [None, None], forced=[forced_token, None])
    assert rows[0].token_id == forced_token
    assert rows[0].logprob == pytest.approx(float(ref[0, forced_token]))
    assert rows[1].token_id == int(lg[1].argmax())


def test_a_sampled_row_needs_its_generator():
    with pytest.raises(ValueError, match="generator"):
        sample(logits(1), [SamplingParams(temperature=1.0)], [None])


def test_top_k_keeps_exactly_k_tokens():
    lg = torch.tensor([[5.0, 4.0, 3.0, 2.0, -10.0]])
    assert set(draws(SamplingParams(temperature=50.0, top_k=3, seed=0), lg, 300)) == {0, 1, 2}
    # top_k at or above the vocabulary size cuts nothing
    assert set(draws(SamplingParams(temperature=50.0, top_k=5, seed=0), lg, 300)) == {0, 1, 2, 3, 4}


def test_top_p_stops_once_the_mass_reaches_it_exactly():
    lg = torch.log(torch.tensor([[2.0, 1.0, 1.0]]))
    probs = torch.softmax(lg[0], -1)
    assert probs.tolist() == [0.5, 0.25, 0.25]  # exact in fp32: the boundary below is exact too
    assert set(draws(SamplingParams(top_p=0.5, seed=0), lg, 100)) == {0}
    assert set(draws(SamplingParams(top_p=0.75, seed=0), lg, 200)) == {0, 1}


def test_boundary_values_are_accepted_and_sequences_become_tuples():
    p = SamplingParams(max_tokens=1, logprobs=0, stop=["x"], stop_token_ids=[2], forced_tokens=[4, 5])  # type: ignore[arg-type]
    assert (p.max_tokens, p.logprobs) == (1, 0)
    assert (p.stop, p.stop_token_ids, p.forced_tokens) == (("x",), (2,), (4, 5))
    assert SamplingParams(logprobs=20).logprobs == 20
    assert hash(p) == hash(SamplingParams(max_tokens=1, logprobs=0, stop=("x",), stop_token_ids=(2,),
                                          forced_tokens=(4, 5)))


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_bad_sampling_values_are_clear_typed_errors(kwargs, msg):
    with pytest.raises(InvalidRequest, match=msg):
        SamplingParams(**kwargs)
