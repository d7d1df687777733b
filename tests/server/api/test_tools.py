"""Tools and structured outputs against the real server (tiny model): every response and chunk
validates against the openai package's own types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from server.api.tools import render_messages
from server.prompt import chat_prompt
from tests.server.api.test_tool_format import ADD

USER = {"role": "user", "content": "What is 2 + 3? Use the add tool."}
SCHEMA = ADD["function"]["parameters"]
BASE = {"model": "coder", "messages": [USER], "tools": [ADD], "temperature": 0, "max_tokens": 64}


def valid(value: object, schema: dict) -> bool:
    """The subset of JSON Schema these tests use: objects of required integer properties."""
    if not isinstance(value, dict) or not set(schema["required"]) <= set(value):
        return False
    if schema.get("additionalProperties") is False and set(value) - set(schema["properties"]):
        return False
    return all(type(value[k]) is int for k in value if k in schema["properties"])


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def whole(url: str, body: dict) -> ChatCompletion:
    r = post(url, body)
    assert r.status_code == 200, r.text
    return ChatCompletion.model_validate(r.json())


def streamed(url: str, body: dict) -> list[ChatCompletionChunk]:
    out = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(ChatCompletionChunk.model_validate(json.loads(line[6:])))
    return out


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_call_is_valid(server_url: str, choice: object) -> None:
    res = whole(server_url, {**BASE, "tool_choice": choice})
    c = res.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert c.message.content is None and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.function.name == "add" and call.id.startswith("call_")  # type: ignore[union-attr]
        assert valid(json.loads(call.function.arguments), SCHEMA), call  # type: ignore[union-attr]


def test_stream_gives_the_same_calls(server_url: str) -> None:
    body = {**BASE, "tool_choice": "required", "parallel_tool_calls": False}
    res = whole(server_url, body)
    chunks = streamed(server_url, body)
    calls = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]
    assert len(calls) == 1 == len(res.choices[0].message.tool_calls or [])
    assert not any(c.delta.content for ch in chunks for c in ch.choices)
    got = res.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert calls[0].function.name == got.function.name and calls[0].function.arguments == got.function.arguments  # type: ignore[union-attr]
    assert calls[0].id and calls[0].id.startswith("call_")  # stable ids: derived from each request's own id


def test_none_and_auto_answer(server_url: str) -> None:
    res = whole(server_url, {**BASE, "tool_choice": "none"})
    assert res.choices[0].finish_reason in ("stop", "length") and res.choices[0].message.tool_calls is None
    auto = whole(server_url, {**BASE, "tool_choice": "auto"})
    m = auto.choices[0].message
    assert (m.tool_calls is None) != (m.content is None)
    chunks = streamed(server_url, {**BASE, "tool_choice": "auto"})
    assert len([c for ch in chunks for c in ch.choices if c.finish_reason]) == 1


def test_history_with_calls_and_results(server_url: str) -> None:
    msgs = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    res = whole(server_url, {**BASE, "messages": msgs})
    assert res.choices[0].message.content is not None or res.choices[0].message.tool_calls


def test_response_format_json_schema(server_url: str) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    res = whole(server_url, {"model": "coder", "messages": [USER], "temperature": 0, "max_tokens": 30,
                             "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "a", "schema": schema, "strict": True}}})
    assert valid(json.loads(res.choices[0].message.content or ""), schema), res.choices[0].message
    res = whole(server_url, {"model": "coder", "messages": [USER], "temperature": 0, "max_tokens": 30,
                             "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(res.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(("extra", "words"), [
    ({"tool_choice": {"type": "function", "function": {"name": "mul"}}}, ["mul", "not among"]),
    ({"tools": [], "tool_choice": "required"}, ["required", "tools"]),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, ["name"]),
    ({"tools": [ADD, ADD]}, ["unique"]),
    ({"tool_choice": "sometimes"}, ["tool_choice"]),
    ({"response_format": {"type": "json_schema"}}, ["json_schema"]),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, []),
])
def test_bad_tools_are_refused(server_url: str, extra: dict, words: list[str]) -> None:
    r = post(server_url, {**BASE, **extra})
    if not words:  # an empty tool_calls list on a user message is harmless
        assert r.status_code == 200
        return
    assert r.status_code in (400, 422), r.text  # 400: a value of the wrong type or enum, 422: a wrong combination
    msg = r.json()["error"]["message"]
    assert all(w in msg for w in words), msg


def test_tool_prompt_sits_after_the_invocation_point(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from agentshare.protocol import ChatMessage, Tool

    tok: Any = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [ChatMessage(role="user", content="shared doc " * 5), ChatMessage(**USER)]  # type: ignore[arg-type]
    plain = render_messages(msgs, [], native=False)
    with_tools = render_messages(msgs, [Tool.model_validate(ADD)], native=False)
    a, b = chat_prompt(tok, plain[:-1], plain[-1:]), chat_prompt(tok, with_tools[:-1], with_tools[-1:])
    assert a.context_len == b.context_len > 0 and a.token_ids[:a.turn_start] == b.token_ids[:b.turn_start]
    assert len(b.token_ids) > len(a.token_ids)
