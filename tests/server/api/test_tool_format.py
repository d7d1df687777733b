"""The tool format without a server: prompt rendering, grammars, parsing, stream hold-back."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from agentshare.protocol import ChatCompletionRequest, ChatMessage, Tool
from server.api.tools import (
    TOOL_PROMPT,
    call_grammar,
    call_id,
    constraint_of,
    could_be_call,
    parse_tool_calls,
    render_messages,
)

ADD: dict[str, Any] = {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                                                       "required": ["a", "b"], "additionalProperties": False}}}
USER = {"role": "user", "content": "What is 2 + 3?"}


def req(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], **kw})


def test_tool_prompt_goes_on_the_final_message_only() -> None:
    msgs = [ChatMessage(role="user", content="doc"), ChatMessage(**USER)]  # type: ignore[arg-type]
    out = render_messages(msgs, [Tool.model_validate(ADD)], native=False)
    assert out[0] == {"role": "user", "content": "doc"}
    assert out[1]["content"].startswith(USER["content"]) and "<tools>" in out[1]["content"]
    listed = json.loads(out[1]["content"].split("<tools>")[1].split("</tools>")[0])
    assert listed == [{"name": "add", "description": "Add two integers", "parameters": ADD["function"]["parameters"]}]
    assert render_messages(msgs, [], native=False)[1]["content"] == USER["content"]


def test_history_calls_and_results_render_as_text() -> None:
    msgs = [ChatMessage(**USER),  # type: ignore[arg-type]
            ChatMessage(role="assistant", tool_calls=[{"id": "c1", "function": {"name": "add",  # type: ignore[list-item]
                                                                                  "arguments": '{"a": 2, "b": 3}'}}]),
            ChatMessage(role="tool", content="5", tool_call_id="c1")]
    out = render_messages(msgs, [], native=False)
    assert out[1] == {"role": "assistant", "content": '<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}]</tool_call>'}
    assert out[2]["role"] == "tool" and out[2]["content"].startswith("5\n\n") and "tool results" in out[2]["content"]


def test_parse_round_trip_and_refusals() -> None:
    calls = parse_tool_calls('<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}, '
                             '{"name": "add", "arguments": {"a": 1, "b": 1}}]</tool_call>', "r")
    assert calls is not None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 2, "b": 3},
                                                                                              {"a": 1, "b": 1}]
    assert [c["id"] for c in calls] == [call_id("r", 0), call_id("r", 1)] and calls[0]["id"] != calls[1]["id"]
    assert len(calls[0]["id"]) == len("call_") + 24
    for bad in ["<tool_call>[{\"name\": 1}]</tool_call>", "<tool_call>[not json]</tool_call>",
                "<tool_call>[]</tool_call>", "say <tool_call>[]</tool_call>", "plain"]:
        assert parse_tool_calls(bad, "r") is None, bad


def test_hold_back() -> None:
    assert all(could_be_call(s) for s in ["", "<", " <tool", "<tool_call>[{\"na"])
    assert not any(could_be_call(s) for s in ["Hi", "<b>", "x<tool_call>"])


@pytest.mark.parametrize(("kw", "kind"), [
    ({}, None), ({"tools": [ADD], "tool_choice": "none"}, None), ({"response_format": {"type": "text"}}, None),
    ({"tools": [ADD]}, "lark"), ({"tools": [ADD], "tool_choice": "required"}, "lark"),
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}},
     "json_schema"),
])
def test_constraint_of(kw: dict, kind: str | None) -> None:
    c = constraint_of(req(**kw))
    assert (c.kind if c else None) == kind


def _accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher accepts ``text`` as a whole output of ``grammar`` (by bytes)."""
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTok()))
    m = llguidance.LLMatcher(tok, llguidance.grammar_from("lark", grammar))
    for b in text.encode():
        if not m.consume_token(b):
            return False
    return m.is_accepting()


class _ByteTok:
    """A byte-level toy tokenizer for llguidance (token i = byte i, 256 = end)."""

    eos_token_id = 256
    bos_token_id = None

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.special_token_ids = [256]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


@pytest.mark.parametrize(("parallel", "or_text", "text", "ok"), [
    (True, False, '<tool_call>[{"name":"add","arguments":{"a":2,"b":3}}]</tool_call>', True),
    (True, False, '<tool_call>[{"name":"add","arguments":{"a":2,"b":3}},{"name":"add","arguments":'
                  '{"a":1,"b":1}}]</tool_call>', True),
    (False, False, '<tool_call>[{"name":"add","arguments":{"a":2,"b":3}},{"name":"add","arguments":'
                   '{"a":1,"b":1}}]</tool_call>', False),
    (True, False, '<tool_call>[{"name":"sub","arguments":{"a":2,"b":3}}]</tool_call>', False),
    (True, False, '<tool_call>[{"name":"add","arguments":{"a":"2"}}]</tool_call>', False),
    (True, False, "The answer is 5.", False),
    (True, True, "The answer is 5.", True),
    (True, True, "<b>5</b>", False),
])
def test_call_grammar(parallel: bool, or_text: bool, text: str, ok: bool) -> None:
    g = call_grammar([Tool.model_validate(ADD)], parallel=parallel, or_text=or_text)
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", g)) == ""
    assert _accepts(g, text) is ok


def test_prompt_template_is_documented_format() -> None:
    assert "<tools>" in TOOL_PROMPT and "<tool_call>[" in TOOL_PROMPT


NOARGS: dict[str, Any] = {"type": "function", "function": {"name": "now"}}


@pytest.mark.parametrize(("text", "ok"), [
    ('<tool_call>[{"name":"add","arguments":{"a":2,"b":3}}]</tool_call>', True),
    ('<tool_call>[{"name":"add"}]</tool_call>', False),  # arguments are required
    ('<tool_call>[{"arguments":{"a":2,"b":3}}]</tool_call>', False),  # so is the name
    ('<tool_call>[{"name":"add","arguments":{"a":2,"b":3},"why":"x"}]</tool_call>', False),  # no extra keys
    ('<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}]</tool_call>', False),  # compact JSON only
    ('<tool_call>[{"name":"now","arguments":{}}]</tool_call>', True),  # a tool without parameters: an object
    ('<tool_call>[{"name":"now","arguments":[]}]</tool_call>', False),
])
def test_call_grammar_keys(text: str, ok: bool) -> None:
    g = call_grammar([Tool.model_validate(ADD), Tool.model_validate(NOARGS)], parallel=True)
    assert _accepts(g, text) is ok


def test_auto_allows_text_and_required_does_not() -> None:
    tools = {"tools": [ADD]}
    auto, required = constraint_of(req(**tools)), constraint_of(req(**tools, tool_choice="required"))
    assert auto is not None and required is not None
    assert _accepts(auto.value, "The answer is 5.") and not _accepts(required.value, "The answer is 5.")
    single = constraint_of(req(**tools, tool_choice="required", parallel_tool_calls=False))
    assert single is not None
    two = '<tool_call>[{"name":"add","arguments":{"a":2,"b":3}},{"name":"add","arguments":{"a":1,"b":1}}]</tool_call>'
    assert _accepts(required.value, two) and not _accepts(single.value, two)


def test_response_format_schema_is_the_callers() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    c = constraint_of(req(response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}))
    assert c is not None and json.loads(c.value) == schema


def test_a_tool_without_parameters_is_listed_with_an_empty_object() -> None:
    out = render_messages([ChatMessage(**USER)], [Tool.model_validate(NOARGS)], native=False)  # type: ignore[arg-type]
    listed = json.loads(out[0]["content"].split("<tools>")[1].split("</tools>")[0])
    assert listed == [{"name": "now", "parameters": {"type": "object", "properties": {}}}]


def test_an_assistant_message_with_text_and_calls_keeps_both() -> None:
    msgs = [ChatMessage(**USER),  # type: ignore[arg-type]
            ChatMessage(role="assistant", content="Let me add.",
                        tool_calls=[{"id": "c1", "function": {"name": "add", "arguments": "{}"}}]),  # type: ignore[list-item]
            ChatMessage(role="user", content="go on")]
    out = render_messages(msgs, [], native=False)
    assert out[1]["content"] == 'Let me add.\n<tool_call>[{"name": "add", "arguments": {}}]</tool_call>'
    assert out[2] == {"role": "user", "content": "go on"}  # no tools: nothing appended
    plain = render_messages([ChatMessage(role="assistant", content="hi"), ChatMessage(**USER)], [], native=False)  # type: ignore[arg-type]
    assert plain[0] == {"role": "assistant", "content": "hi"}


def test_parsed_calls_have_the_openai_shape() -> None:
    calls = parse_tool_calls('<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}]</tool_call>', "r:0")
    assert calls is not None and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert parse_tool_calls('<tool_call>[{"name": "add", "arguments": {}}]', "r:0") is None  # unclosed
    assert parse_tool_calls('[{"name": "add", "arguments": {}}]</tool_call>', "r:0") is None  # unopened


def test_template_supports_tools() -> None:
    from server.api.tools import template_supports_tools

    class Tok:
        def __init__(self, template: object) -> None:
            self.chat_template = template

    assert template_supports_tools(Tok("{% if tools %}{{ tools | tojson }}{% endif %}"))
    assert not template_supports_tools(Tok("{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    assert not template_supports_tools(Tok(None)) and not template_supports_tools(object())


def test_explicit_auto_allows_text_and_defaults_hold_calls() -> None:
    auto = constraint_of(req(tools=[ADD], tool_choice="auto"))
    assert auto is not None and _accepts(auto.value, "Five.")
    assert not _accepts(call_grammar([Tool.model_validate(ADD)], parallel=True), "Five.")  # or_text is off by default


def test_a_json_schema_without_a_schema_is_any_json() -> None:
    c = constraint_of(req(response_format={"type": "json_schema", "json_schema": {"name": "x"}}))
    assert c is not None and (c.kind, c.value) == ("json_schema", "{}")


def test_a_call_without_arguments_has_empty_ones() -> None:
    calls = parse_tool_calls('<tool_call>{"name": "add"}</tool_call>', "r")
    assert calls is not None and calls[0]["function"] == {"name": "add", "arguments": "{}"}
