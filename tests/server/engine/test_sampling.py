import pytest
import torch

from agentshare.protocol import SamplingSpec
from server.engine.errors import InvalidRequest
from server.engine.sampling import SamplingParams, _penalize, sample

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


# ---- penalties ---------------------------------------------------------------------------------
# What the sampler sees is checked through the public API: a penalty shifts the greedy choice
# exactly at the margin the arithmetic predicts (logits of 1 and 3 tie at a shift of 2, and
# ``argmax`` takes the first of a tie), and seeded draws equal those from the logits penalized
# by hand.


def greedy(row: list[float], tokens: tuple[list[int], list[int]], **penalties: float) -> int:
    return sample(torch.tensor([row]), [SamplingParams(temperature=0, **penalties)], [None], tokens=[tokens])[0].token_id


@pytest.mark.parametrize(("penalties", "generated", "token"), [
    ({"frequency_penalty": 0.5}, [1, 1, 1], 1),  # 3 - 1.5 > 1
    ({"frequency_penalty": 0.5}, [1, 1, 1, 1], 0),  # 3 - 2 == 1: a tie, the first wins
    ({"presence_penalty": 1.9}, [1, 1, 1, 1], 1),  # once per token, whatever its count: 3 - 1.9
    ({"presence_penalty": 2.0}, [1], 0),  # 3 - 2
    ({"frequency_penalty": 1.0, "presence_penalty": 1.0}, [1], 0),  # 3 - 1 - 1
    ({"frequency_penalty": 1.0, "presence_penalty": 0.9}, [1], 1),
    ({"frequency_penalty": -2.0}, [0], 0),  # negative: encourages a repeat, 1 + 2 == 3
    ({"presence_penalty": -1.9}, [0], 1),
    ({"repetition_penalty": 3.0}, [1], 0),  # positive logit divided: 3 / 3 == 1
    ({"repetition_penalty": 2.9}, [1], 1),
])
def test_penalties_shift_the_logits_by_exactly_their_formula(penalties, generated, token):
    assert greedy([1.0, 3.0], ([], generated), **penalties) == token


def test_the_repetition_penalty_reads_the_prompt_and_multiplies_negative_logits():
    assert greedy([1.0, 3.0], ([1], []), repetition_penalty=3.0) == 0  # a prompt token counts
    assert greedy([1.0, 3.0], ([1], []), repetition_penalty=2.9) == 1
    assert greedy([-1.0, -3.0, -2.5], ([0], []), repetition_penalty=2.5) == 0  # -1 * 2.5 == -2.5: tie, first
    assert greedy([-1.0, -3.0, -2.4], ([0], []), repetition_penalty=2.5) == 2
    assert greedy([-1.0, -3.0], ([1], []), repetition_penalty=0.2) == 1  # below 1 rewards a repeat: -0.6
    assert greedy([1.0, 3.0], ([1, 1, 1], [1, 1]), repetition_penalty=2.0) == 1  # once, not per occurrence


def test_the_repetition_penalty_divides_every_positive_logit_even_below_1():
    assert greedy([0.5, 0.4], ([0], []), repetition_penalty=2.0) == 1  # 0.5 / 2 < 0.4
    assert greedy([0.5, 0.4], ([0], []), repetition_penalty=1.2) == 0  # 0.5 / 1.2 > 0.4
    assert greedy([1.0, 0.6], ([], [0]), repetition_penalty=2.0) == 1  # an output token counts


@pytest.mark.parametrize(("penalties", "generated", "token"), [
    ({"frequency_penalty": 1.0}, [1, 1], 0),  # 3 - 2 == 1: a tie, the first wins
    ({"presence_penalty": 1.0, "repetition_penalty": 1.5}, [1], 0),  # 3 / 1.5 - 1 == 1
    ({"frequency_penalty": 1.0, "repetition_penalty": 2.0}, [1], 0),  # 3 / 2 - 1 < 1
])
def test_each_penalty_applies_at_1_or_2_alone_or_after_the_repetition_penalty(penalties, generated, token):
    assert greedy([1.0, 3.0], ([], generated), **penalties) == token


def test_penalties_are_computed_in_the_rows_dtype():
    p = SamplingParams(frequency_penalty=0.1, presence_penalty=0.3)
    got = _penalize(torch.zeros(3, dtype=torch.float64), p, [], [0, 0, 0, 1])
    assert got.dtype == torch.float64
    assert got.tolist() == [0.0 - 0.1 * 3 - 0.3, 0.0 - 0.1 - 0.3, 0.0]  # float64, no float32 rounding
    half = _penalize(torch.zeros(3, dtype=torch.float16), p, [], [0, 1])
    assert half.dtype == torch.float16


@pytest.mark.parametrize("repetition", [1e4, 1e300, 1e-4, 1e-300])  # 1e300 / 1e-300: inf / 0 in float32
def test_a_finite_logit_stays_finite_and_minus_inf_stays_under_any_repetition_penalty(repetition):
    big = torch.finfo(torch.float32).max
    row = torch.tensor([-3e38, 3e38, 0.0, -1.0, 2.0, float("-inf")])
    got = _penalize(row, SamplingParams(repetition_penalty=repetition), [0, 1, 2, 3, 4, 5], [])
    assert torch.isfinite(got[:5]).all() and got[5] == float("-inf")
    assert got[2] == 0.0  # 0 times an infinite penalty is no NaN
    if repetition > 1:
        assert got[0] == -big and got[3] < -1.0 and 0.0 <= got[4] < 2.0  # clamped, not -inf
    else:
        assert got[1] == big and got[4] > 2.0 and -1.0 < got[3] <= 0.0  # clamped, not +inf


def test_a_finite_logit_pushed_past_float32_still_beats_minus_inf():
    assert greedy([float("-inf"), -3e38], ([1], []), repetition_penalty=10.0) == 1


def test_frequency_and_presence_penalties_ignore_the_prompt():
    prompt = [1] * 20
    assert greedy([1.0, 3.0], (prompt, []), frequency_penalty=2.0, presence_penalty=2.0) == 1
    assert greedy([1.0, 3.0], (prompt, [1]), frequency_penalty=2.0, presence_penalty=2.0) == 0


def test_token_ids_outside_the_row_are_ignored():
    assert greedy([1.0, 3.0], ([-1, 7, 2**40], [5, -3]), repetition_penalty=5.0, presence_penalty=2.0) == 1


def test_a_strong_penalty_changes_greedy_and_leaves_the_logprobs_raw():
    lg = logits(1, seed=8)
    top = int(lg[0].argmax())
    plain = SamplingParams(temperature=0, logprobs=5)
    penalized = SamplingParams(temperature=0, logprobs=5, frequency_penalty=2.0, presence_penalty=2.0,
                               repetition_penalty=1.5)
    a = sample(lg, [plain], [None])[0]
    b = sample(lg, [penalized], [None], tokens=[([top], [top, top])])[0]
    assert a.token_id == top and b.token_id != top
    ref = torch.log_softmax(lg[0], -1)
    assert b.logprob == pytest.approx(float(ref[b.token_id]), abs=1e-6)  # the raw model's, not the penalized
    assert b.top_logprobs == a.top_logprobs and b.top_logprobs[0][0] == top


def test_sampled_rows_draw_from_the_penalized_logits():
    lg = logits(1, seed=9)
    prompt, output = [3, 4, 5], [5, 7, 7, 7, 11]
    p = SamplingParams(temperature=0.8, seed=21, repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4)
    by_hand = lg.clone()
    for t in (3, 4, 5, 7, 11):
        v = by_hand[0, t]
        by_hand[0, t] = v / 1.7 if v > 0 else v * 1.7
    for t, count in ((5, 1), (7, 3), (11, 1)):
        by_hand[0, t] -= 0.6 * count - 0.4
    plain = SamplingParams(temperature=0.8, seed=21)
    g, h = p.generator(), plain.generator()
    got = [sample(lg, [p], [g], tokens=[(prompt, output)])[0].token_id for _ in range(40)]
    want = [sample(by_hand, [plain], [h])[0].token_id for _ in range(40)]
    assert got == want and len(set(got)) > 1


def test_a_penalized_row_needs_its_tokens_unless_forced():
    lg = logits(1)
    with pytest.raises(ValueError, match="tokens"):
        sample(lg, [SamplingParams(temperature=0, presence_penalty=0.5)], [None])
    assert sample(lg, [SamplingParams(temperature=0, presence_penalty=0.5)], [None], forced=[3])[0].token_id == 3
    assert sample(lg, [SamplingParams(temperature=0)], [None])[0].token_id == int(lg.argmax())  # no penalty: none needed
    assert SamplingParams().penalized is False
    assert all(SamplingParams(**{k: v}).penalized for k, v in
               (("repetition_penalty", 1.1), ("frequency_penalty", -0.1), ("presence_penalty", 0.1)))


def test_penalties_at_their_limits_are_accepted():
    p = SamplingParams(repetition_penalty=1e-3, frequency_penalty=-2.0, presence_penalty=2.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1e-3, -2.0, 2.0)
    assert SamplingParams(frequency_penalty=2.0, presence_penalty=-2.0, repetition_penalty=100.0).penalized


@pytest.mark.parametrize(("kwargs", "msg"), [
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"frequency_penalty": 2.01}, r"frequency_penalty must be between -2 and 2 \(0 disables it\), got 2.01"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty must be between -2 and 2"),
    ({"presence_penalty": float("-inf")}, "presence_penalty"),
    ({"presence_penalty": True}, "presence_penalty"),
])
def test_bad_penalties_are_clear_typed_errors(kwargs, msg):
    with pytest.raises(InvalidRequest, match=msg):
        SamplingParams(**kwargs)


# ---- from a request's spec ---------------------------------------------------------------------


def test_from_spec_applies_the_servers_defaults_to_what_the_request_leaves_out():
    assert SamplingParams.from_spec(SamplingSpec(), default_max_tokens=16) == SamplingParams(max_tokens=16)
    assert SamplingParams.from_spec(SamplingSpec()) == SamplingParams()


def test_from_spec_carries_every_field_the_request_sets():
    spec = SamplingSpec(max_tokens=5, temperature=0.7, top_p=0.5, top_k=3, seed=9, stop=("x",), stop_token_ids=(2,),
                        ignore_eos=True, logprobs=4, forced_tokens=(1,), repetition_penalty=1.2,
                        frequency_penalty=-0.5, presence_penalty=0.5)
    assert SamplingParams.from_spec(spec, default_max_tokens=99) == SamplingParams(**spec.model_dump())


@pytest.mark.parametrize(("given", "field", "value"), [
    ({"temperature": 1e-300}, "temperature", 0.0),  # below 1e-5: greedy, as vLLM
    ({"temperature": 0.99e-5}, "temperature", 0.0),
    ({"temperature": 1e-5}, "temperature", 1e-5),
    ({"temperature": 0.0}, "temperature", 0.0),
    ({"top_p": 1e-300}, "top_p", 1e-6),  # float32 would make it 0: it keeps the top token anyway
    ({"top_p": 1e-6}, "top_p", 1e-6),
    ({"top_p": 0.3}, "top_p", 0.3),
    ({"top_k": -1}, "top_k", 0),  # vLLM's "off"
    ({"top_k": 0}, "top_k", 0),
    ({"top_k": 7}, "top_k", 7),
])
def test_from_spec_clamps_what_float32_sampling_cannot_represent(given, field, value):
    assert getattr(SamplingParams.from_spec(SamplingSpec(**given)), field) == value


def test_from_spec_refuses_a_bad_value_as_the_engine_does():
    with pytest.raises(InvalidRequest, match="presence_penalty"):
        SamplingParams.from_spec(SamplingSpec(presence_penalty=5.0))


def test_from_spec_carries_the_constraint() -> None:
    from agentshare.protocol import ConstraintSpec, SamplingSpec
    from server.engine.constraints import Constraint

    spec = SamplingSpec(constraint=ConstraintSpec(kind="regex", value="a+"))
    assert SamplingParams.from_spec(spec).constraint == Constraint("regex", "a+")
    assert SamplingParams.from_spec(SamplingSpec()).constraint is None
