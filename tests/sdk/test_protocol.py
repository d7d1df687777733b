"""The wire schemas' own rules, without a server: what a request may hold and what it means."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from agentshare.protocol import (
    MAX_STOP,
    MAX_STOP_CHARS,
    SEED_LIMIT,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContextCreate,
    ErrorResponse,
    ExplainRequest,
    GenerateRequest,
    SamplingSpec,
    Usage,
    _Sampling,
)

USER = {"role": "user", "content": "hi"}


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "coder", "messages": [USER], **fields})


def refused(make: object, **fields: object) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        make(**fields)  # type: ignore[operator]
    return info.value


def test_lone_surrogates_are_refused_with_their_position() -> None:
    err = refused(chat, user="ok\ud800")
    (detail,) = err.errors()
    assert detail["type"] == "invalid_unicode" and detail["loc"] == ("user",)
    assert detail["ctx"] == {"code": "D800", "position": 2}
    assert chat(user="héllo ✓").user == "héllo ✓"


def test_a_message_needs_content_unless_it_is_the_assistants() -> None:
    refused(ChatMessage, role="user")
    refused(ChatMessage, role="tool", content=None)
    assert ChatMessage(role="assistant").text() == ""


def test_message_text_joins_its_parts_and_developer_reads_as_system() -> None:
    parts = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "bc"}]})
    assert parts.text() == "abc"
    assert ChatMessage(role="developer", content="x").as_template_message() == {"role": "system", "content": "x"}
    assert ChatMessage(role="user", content="y").as_template_message() == {"role": "user", "content": "y"}
    assert ChatMessage(role="system", content="z").as_template_message()["role"] == "system"


def test_stop_is_always_a_tuple_of_strings() -> None:
    assert chat().stop_list() == ()
    assert chat(stop="x").stop_list() == ("x",)
    assert chat(stop=["a", "b"]).stop_list() == ("a", "b")


@pytest.mark.parametrize("stop", [[""], "", ["a", ""], ["s"] * (MAX_STOP + 1), "x" * (MAX_STOP_CHARS + 1),
                                  ["ok", "x" * (MAX_STOP_CHARS + 1)]])
def test_bad_stops_are_refused_on_the_stop_field(stop: object) -> None:
    (detail,) = refused(chat, stop=stop).errors()
    assert detail["loc"][0] == "stop"


def test_stops_at_their_limits_are_accepted() -> None:
    assert len(chat(stop=["s"] * MAX_STOP).stop_list()) == MAX_STOP
    assert chat(stop="x" * MAX_STOP_CHARS).stop_list() == ("x" * MAX_STOP_CHARS,)


def test_usage_is_included_only_when_streaming_asks_for_it() -> None:
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert chat(stream=False, stream_options={"include_usage": True}).include_usage is False
    assert chat(stream=True).include_usage is False
    assert chat(stream=True, stream_options={"include_usage": False}).include_usage is False


def test_every_choice_seed_must_fit_64_bits() -> None:
    # choice i samples with seed + i: the last one, seed + n - 1, must stay below 2**64
    assert chat(seed=SEED_LIMIT - 3, n=3).seed == SEED_LIMIT - 3
    assert chat(seed=SEED_LIMIT - 1).seed == SEED_LIMIT - 1
    refused(chat, seed=SEED_LIMIT - 3, n=4)
    refused(chat, seed=SEED_LIMIT - 1, n=2)
    assert chat(n=16).n == 16  # no seed: no limit from it


def test_the_token_limit_prefers_max_completion_tokens() -> None:
    assert chat(max_completion_tokens=5, max_tokens=9).token_limit() == 5
    assert chat(max_tokens=9).token_limit() == 9
    assert chat().token_limit() is None
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "p", "max_tokens": 7})
    assert completion.token_limit() == 7


def test_usage_and_error_shapes() -> None:
    u = Usage.of(prompt=3, completion=4, cached=1)
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (3, 4, 7)
    assert u.prompt_tokens_details.cached_tokens == 1
    body = ErrorResponse.of("bad", param="n", code="invalid_value").model_dump()["error"]
    assert body == {"message": "bad", "type": "invalid_request_error", "param": "n", "code": "invalid_value"}
    assert ErrorResponse.of("slow down", type="rate_limit_error").error.type == "rate_limit_error"


def test_native_requests_take_exactly_one_of_messages_or_text() -> None:
    assert ContextCreate(text="doc").kind == "text"
    assert ContextCreate.model_validate({"messages": [USER]}).kind == "chat"
    refused(ContextCreate)
    refused(ContextCreate.model_validate, obj={"messages": [USER], "text": "doc"})
    refused(ContextCreate, messages=[])
    assert GenerateRequest.model_validate({"agent": "a", "text": "t"}).kind == "text"


def test_explain_takes_messages_or_a_prompt_or_a_context() -> None:
    assert ExplainRequest(agent="a", context_id="ctx_1").context_id == "ctx_1"
    assert ExplainRequest(agent="a", prompt="p").prompt == "p"
    assert ExplainRequest.model_validate({"agent": "a", "messages": [USER]}).messages
    refused(ExplainRequest, agent="a")
    refused(ExplainRequest.model_validate, obj={"agent": "a", "messages": [USER], "prompt": "p"})


# ---- what a request asks of the sampler --------------------------------------------------------


def completion_request(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "p", **fields})


def generate_request(**fields: object) -> GenerateRequest:
    return GenerateRequest.model_validate({"agent": "a", "text": "t", **fields})


KNOBS = {"temperature": 0.5, "top_p": 0.25, "top_k": 7, "seed": 11, "stop": ["x", "y"], "ignore_eos": True,
         "repetition_penalty": 1.3, "frequency_penalty": -0.5, "presence_penalty": 2.0}
ASKED = {**KNOBS, "stop": ("x", "y"), "max_tokens": 6}


@pytest.mark.parametrize(("make", "extra", "logprobs"), [
    (chat, {"max_completion_tokens": 6, "max_tokens": 9, "logprobs": True, "top_logprobs": 3}, 3),
    (completion_request, {"max_tokens": 6, "logprobs": 0}, 0),
    (generate_request, {"max_tokens": 6, "logprobs": 5}, 5),
])
def test_every_request_carries_its_sampling_fields_into_its_spec(make: Any, extra: dict[str, Any],
                                                                  logprobs: int) -> None:
    spec = make(**KNOBS, **extra).sampling()
    assert spec == SamplingSpec(**ASKED, logprobs=logprobs)


@pytest.mark.parametrize("make", [chat, completion_request, generate_request])
def test_a_request_that_sets_nothing_leaves_every_default_to_the_server(make: Any) -> None:
    assert make().sampling() == SamplingSpec()


def test_chat_logprobs_are_the_top_logprobs_count_only_when_asked() -> None:
    assert chat(logprobs=True).sampling().logprobs == 0
    assert chat(logprobs=False, top_logprobs=4).sampling().logprobs is None
    assert chat(top_logprobs=4).sampling().logprobs is None
    assert chat(max_tokens=9).sampling().max_tokens == 9


def test_a_request_type_without_a_logprobs_field_asks_for_none() -> None:
    assert _Sampling().logprob_count() is None
    assert _Sampling(max_tokens=3).sampling() == SamplingSpec(max_tokens=3)


def test_the_spec_refuses_a_field_the_engine_does_not_have() -> None:
    refused(SamplingSpec, min_p=0.1)


@pytest.mark.parametrize(("field", "value"), [
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("repetition_penalty", float("nan")), ("frequency_penalty", 2.01), ("frequency_penalty", -2.01),
    ("presence_penalty", 3), ("presence_penalty", float("nan")),
])
def test_penalties_out_of_range_are_refused_on_their_field(field: str, value: float) -> None:
    for make in (chat, completion_request, generate_request):
        assert refused(make, **{field: value}).errors()[0]["loc"] == (field,)


def test_penalties_at_their_limits_are_accepted() -> None:
    assert chat(frequency_penalty=-2, presence_penalty=2, repetition_penalty=1e-9).sampling().presence_penalty == 2


@pytest.mark.parametrize(("field", "value", "neutral"), [
    ("min_p", 0.05, "or 0"), ("typical_p", 0.9, "or 1"), ("min_tokens", 2, "or 0"), ("best_of", 3, "or 1"),
    ("use_beam_search", True, "or false"), ("length_penalty", 0.5, "or 1"), ("mirostat", 2, "or 0"),
    ("top_a", 0.2, "or 0"), ("logit_bias", {"5": 1.0}, "or {}"), ("guided_json", {"type": "object"}, "null)"),
])
def test_a_sampling_knob_this_server_lacks_is_refused_naming_it(field: str, value: object, neutral: str) -> None:
    makers = [chat, completion_request, generate_request]
    if field in ("best_of", "logit_bias"):  # declared by the OpenAI requests (their own rules apply)
        makers = [generate_request] if field == "logit_bias" else [chat, generate_request]
    for make in makers:
        [err] = refused(make, **{field: value}).errors()
        assert err["type"] == "unsupported_parameter"
        assert err["msg"].startswith(f"{field}: not supported by this server; omit it (or send null")
        assert neutral in err["msg"] and "repetition_penalty" in err["msg"]


def test_unsupported_knobs_at_their_neutral_values_and_unrelated_extras_are_accepted() -> None:
    neutral = {"min_p": 0.0, "typical_p": 1, "min_tokens": 0, "use_beam_search": False, "best_of": 1,
               "length_penalty": 1.0, "logit_bias": {}, "guided_json": None, "bad_words": []}
    unrelated = {"user": "u", "metadata": {"k": "v"}, "store": True, "parallel_tool_calls": False,
                 "some_future_field": {"x": 1}}
    for make in (chat, completion_request, generate_request):
        assert make(**neutral, **unrelated).sampling() == SamplingSpec()
