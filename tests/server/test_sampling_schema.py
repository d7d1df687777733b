"""One sampling schema: the engine's ``SamplingParams`` is it, and every other place derives from
it or is checked against it — the request side's ``SamplingSpec``, the SDK's ``Sampling``, and
the router-to-worker message, which carries it whole."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from agentshare.agent import Sampling
from agentshare.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingSpec,
)
from server.cluster.messages import Generate, PromptFields, SamplingFields
from server.engine.constraints import Constraint
from server.engine.sampling import SamplingParams
from server.prompt import Prompt

ENGINE_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]

EVERY_FIELD_SET: dict[str, Any] = {
    "max_tokens": 7, "temperature": 0.3, "top_p": 0.8, "top_k": 5, "seed": 2**64 - 1, "stop": ("END", "\n\n"),
    "stop_token_ids": (2, 3), "ignore_eos": True, "logprobs": 4, "forced_tokens": (9, 8, 7),
    "repetition_penalty": 1.25, "frequency_penalty": -0.75, "presence_penalty": 1.5,
    "constraint": Constraint("json_schema", '{"type": "object"}'),
}


def test_the_request_spec_has_exactly_the_engines_fields() -> None:
    assert list(SamplingSpec.model_fields) == ENGINE_FIELDS


def test_the_sdk_sampling_fields_are_fields_of_the_request_and_of_the_engine() -> None:
    sdk = {f.name for f in dataclasses.fields(Sampling)}
    assert sdk <= set(GenerateRequest.model_fields)  # what Sampling.wire() sends is read, not ignored
    assert sdk <= set(ENGINE_FIELDS)
    assert {"repetition_penalty", "frequency_penalty", "presence_penalty"} <= sdk


def test_every_request_sampling_field_named_as_the_engines_reaches_the_engine() -> None:
    for model in (ChatCompletionRequest, CompletionRequest, GenerateRequest):
        shared = set(model.model_fields) & set(ENGINE_FIELDS)
        assert {"temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "repetition_penalty",
                "frequency_penalty", "presence_penalty", "max_tokens", "logprobs"} <= shared, model


def test_every_field_survives_the_router_to_worker_message() -> None:
    assert set(EVERY_FIELD_SET) == set(ENGINE_FIELDS)
    params = SamplingParams(**EVERY_FIELD_SET)
    defaults = SamplingParams()
    assert all(getattr(params, f) != getattr(defaults, f) for f in ENGINE_FIELDS)  # none left at its default
    message = Generate(request_id="r1", module="coder", prompt=PromptFields.of(Prompt((1, 2, 3), 2, 2, 2)),
                       params=SamplingFields.of(params))
    arrived = Generate.model_validate_json(message.model_dump_json())
    assert arrived.params.params() == params
    assert type(arrived.params.params().stop) is tuple


def test_a_request_through_the_spec_and_the_message_keeps_every_knob() -> None:
    body = ChatCompletionRequest.model_validate({
        "model": "coder", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7,
        "temperature": 0.3, "top_p": 0.8, "top_k": 5, "seed": 4, "stop": ["END"], "ignore_eos": True,
        "logprobs": True, "top_logprobs": 4, "repetition_penalty": 1.25, "frequency_penalty": -0.75,
        "presence_penalty": 1.5})
    params = SamplingParams.from_spec(body.sampling(), default_max_tokens=100)
    assert params == SamplingParams(max_tokens=7, temperature=0.3, top_p=0.8, top_k=5, seed=4, stop=("END",),
                                    ignore_eos=True, logprobs=4, repetition_penalty=1.25, frequency_penalty=-0.75,
                                    presence_penalty=1.5)
    assert SamplingFields.model_validate_json(SamplingFields.of(params).model_dump_json()).params() == params


def test_a_worker_refuses_a_sampling_field_it_does_not_know() -> None:
    with pytest.raises(ValidationError, match=r"unknown sampling field.*min_p"):
        SamplingFields.model_validate({"max_tokens": 3, "min_p": 0.1})
    with pytest.raises(ValidationError, match="presence_penalty"):
        SamplingFields.model_validate({"max_tokens": 3, "presence_penalty": 9})
