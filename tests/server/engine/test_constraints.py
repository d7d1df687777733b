"""Constrained decoding on the tiny random model (real SmolLM2 tokenizer): whatever a random
model samples at temperature 1, the output matches its constraint."""

from __future__ import annotations

import json
import re

import pytest

from server.engine.constraints import Constraint
from server.engine.errors import InvalidRequest
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason
from server.prompt import chat_prompt
from tests.server.engine.test_core import drain, engine, tokens_of, turn

SCHEMAS = [
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["color", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 3},
]


def valid(value: object, schema: dict) -> bool:
    """The few JSON Schema keywords of SCHEMAS, checked by hand (no jsonschema installed)."""
    if "enum" in schema:
        return value in schema["enum"]
    t = schema["type"]
    if t == "object":
        props = schema["properties"]
        return (isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(props)
                and all(valid(v, props[k]) for k, v in value.items()))
    if t == "array":
        return (isinstance(value, list) and schema["minItems"] <= len(value) <= schema["maxItems"]
                and all(valid(v, schema["items"]) for v in value))
    if t == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema["minimum"] <= value <= schema["maximum"])
    if t == "string":
        return isinstance(value, str) and len(value) <= schema["maxLength"]
    if t == "boolean":
        return isinstance(value, bool)
    raise AssertionError(t)


def texts(events) -> dict[str, str]:
    return {rid: "".join(e.text for e in evs) for rid, evs in events.items()}


def test_200_sampled_requests_of_several_schemas_and_modules_all_parse_and_validate(tiny_model_dir, make_lora):
    core, _ = engine(tiny_model_dir, modules={"a": make_lora("ca", seed=3)})
    want = {}
    for i in range(200):
        schema = SCHEMAS[i % len(SCHEMAS)]
        rid = f"r{i}"
        want[rid] = schema
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=48,
                                constraint=Constraint("json_schema", json.dumps(schema)))
        core.add_request(rid, ("base", "a")[i % 2], chat_prompt(core.tokenizer, [], turn(f"q{i % 7}")), params)
    events = drain(core)
    out = texts(events)
    for rid, schema in want.items():
        assert events[rid][-1].finish_reason is FinishReason.STOP, (rid, out[rid], events[rid][-1])
        assert valid(json.loads(out[rid]), schema), (rid, out[rid])


def test_regex_choice_and_json_object(tiny_model_dir):
    core, _ = engine(tiny_model_dir)
    prompt = chat_prompt(core.tokenizer, [], turn("go"))
    pattern = r"[a-c]{2,4}-[0-9]{3}"
    choices = ["yes", "no", "maybe so", "n/a \"quoted\""]
    for i in range(8):
        core.add_request(f"re{i}", "base", prompt, SamplingParams(seed=i, max_tokens=16,
                                                                  constraint=Constraint("regex", pattern)))
        core.add_request(f"ch{i}", "base", prompt, SamplingParams(seed=i, max_tokens=16,
                                                                  constraint=Constraint("choice", json.dumps(choices))))
        core.add_request(f"jo{i}", "base", prompt, SamplingParams(seed=i, max_tokens=64, temperature=0.0,
                                                                  constraint=Constraint("json_object")))
    events = drain(core)
    out = texts(events)
    for i in range(8):
        assert re.fullmatch(pattern, out[f"re{i}"]), out[f"re{i}"]
        assert out[f"ch{i}"] in choices, out[f"ch{i}"]
        assert events[f"re{i}"][-1].finish_reason is FinishReason.STOP
        assert events[f"ch{i}"][-1].finish_reason is FinishReason.STOP
    for i in range(8):  # greedy on a random model may not close its object in 64 tokens
        if events[f"jo{i}"][-1].finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(out[f"jo{i}"]), dict), out[f"jo{i}"]
        else:
            assert out[f"jo{i}"].startswith("{")


def test_a_lark_grammar_with_embedded_json_schema(tiny_model_dir):
    core, _ = engine(tiny_model_dir)
    grammar = ('start: "<tool>" args "</tool>"\n'
               'args: %json {"type": "object", "properties": {"x": {"enum": [1, 2]}}, '
               '"required": ["x"], "additionalProperties": false, '
               '"x-guidance": {"whitespace_flexible": false}}')
    core.add_request("t", "base", chat_prompt(core.tokenizer, [], turn("call")),
                     SamplingParams(seed=1, max_tokens=32, constraint=Constraint("lark", grammar)))
    out = texts(drain(core))["t"]
    m = re.fullmatch(r"<tool>(.*)</tool>", out)
    assert m and json.loads(m.group(1))["x"] in (1, 2), out


@pytest.mark.parametrize("constraint, message", [
    (Constraint("regex", "a("), "unclosed group"),
    (Constraint("json_schema", '{"type": "foo"}'), "foo"),
    (Constraint("lark", "start: nowhere"), "unknown name"),
])
def test_a_bad_constraint_is_refused_at_admission_and_the_engine_serves_others(tiny_model_dir, constraint, message):
    core, _ = engine(tiny_model_dir)
    prompt = chat_prompt(core.tokenizer, [], turn("hi"))
    with pytest.raises(InvalidRequest, match=message):
        core.add_request("bad", "base", prompt, SamplingParams(constraint=constraint))
    core.add_request("ok", "base", prompt, SamplingParams(max_tokens=4, constraint=Constraint("regex", "[0-9]+")))
    events = drain(core)
    assert set(events) == {"ok"} and re.fullmatch("[0-9]+", texts(events)["ok"])


def test_an_unconstrained_request_is_unchanged_by_a_constrained_neighbour(tiny_model_dir, make_lora):
    """Against the same batch with the neighbour unconstrained (a batch's shape may change the
    forward's rounding; the neighbour's mask must not change anything else)."""
    modules = {"a": make_lora("ca", seed=3)}
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    runs = []
    for constraint in (None, Constraint("regex", "[xyz ]{400}")):
        core, logits = engine(tiny_model_dir, modules=modules)
        prompt = chat_prompt(core.tokenizer, [], turn("tell me"))
        core.add_request("c", "base", prompt, SamplingParams(temperature=0.0, max_tokens=12, logprobs=3,
                                                             ignore_eos=True, constraint=constraint))
        core.add_request("u", "a", prompt, greedy)
        runs.append((drain(core), logits))
    (free, free_logits), (both, both_logits) = runs
    assert len(both["c"]) == len(free["c"]) == 12  # the batches had the same shape at every step
    assert tokens_of(both["u"]) == tokens_of(free["u"])
    assert [(e.logprob, e.top_logprobs) for e in both["u"]] == [(e.logprob, e.top_logprobs) for e in free["u"]]
    assert all(a.equal(b) for a, b in zip(free_logits["u"], both_logits["u"], strict=True))
    assert re.fullmatch("[xyz ]{12,400}", texts(both)["c"]) and tokens_of(both["c"]) != tokens_of(free["c"])
    # the constrained request's logprobs are the raw model's, not the masked distribution's
    raw = both_logits["c"][0].float().log_softmax(-1)
    first = both["c"][0]
    assert first.logprob == pytest.approx(float(raw[first.token_id]), abs=1e-5)
    assert [t for t, _ in first.top_logprobs] == raw.topk(3).indices.tolist()


def test_forced_tokens_pass_through_the_grammar(tiny_model_dir):
    core, _ = engine(tiny_model_dir)
    tok = core.tokenizer
    prompt = chat_prompt(tok, [], turn("hi"))
    good = tuple(tok.encode("ab", add_special_tokens=False))
    bad = tuple(tok.encode("zz", add_special_tokens=False))
    core.add_request("good", "base", prompt, SamplingParams(max_tokens=8, seed=0, forced_tokens=good,
                                                            constraint=Constraint("regex", "ab[0-9]{2}")))
    core.add_request("bad", "base", prompt, SamplingParams(max_tokens=8, seed=0, forced_tokens=bad,
                                                           constraint=Constraint("regex", "ab[0-9]{2}")))
    core.add_request("free", "base", prompt, SamplingParams(max_tokens=3, seed=0))
    events = drain(core)
    assert re.fullmatch("ab[0-9]{2}", texts(events)["good"])
    assert events["bad"][-1].finish_reason is FinishReason.ERROR and "grammar" in events["bad"][-1].error
    assert events["free"][-1].finish_reason is FinishReason.LENGTH


def test_ignore_eos_does_not_continue_a_complete_grammar(tiny_model_dir):
    core, _ = engine(tiny_model_dir)
    core.add_request("c", "base", chat_prompt(core.tokenizer, [], turn("hi")),
                     SamplingParams(max_tokens=16, seed=0, ignore_eos=True, constraint=Constraint("choice", '["ok"]')))
    events = drain(core)["c"]
    assert "".join(e.text for e in events) == "ok" and events[-1].finish_reason is FinishReason.STOP
