"""LangChain's standard unit suite for ChatAgentshare (no server: construction, binding, serialization)."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")
from langchain_core.messages import AIMessage, AIMessageChunk, SystemMessage, ToolMessage
from langchain_tests.unit_tests import ChatModelUnitTests

from agentshare.langchain import ChatAgentshare, _to_wire, _tool_choice


class TestChatAgentshareUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatAgentshare]:
        return ChatAgentshare

    @property
    def chat_model_params(self) -> dict[str, object]:
        return {"model": "base", "base_url": "http://127.0.0.1:9"}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True


def test_agent_alias_and_tool_choice() -> None:
    assert ChatAgentshare(agent="coder").model == "coder"
    assert _tool_choice("any", ["f"]) == "required"
    assert _tool_choice(True, ["f"]) == "required"
    with pytest.raises(ValueError, match="not one of the bound tools"):
        _tool_choice("g", ["f"])


def test_images_are_refused_with_a_reason() -> None:
    from langchain_core.messages import HumanMessage

    with pytest.raises(ValueError, match="text only"):
        _to_wire(HumanMessage([{"type": "image_url", "image_url": {"url": "x"}}]))


def test_openai_tool_calls_are_parsed_whole_and_streamed() -> None:
    """The OpenAI wire format (what the server's function calling sends) into LangChain's fields."""
    from agentshare.langchain import _chunk, _result

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    bad = {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": '}}
    whole = _result({"id": "x", "model": "coder", "choices": [{"index": 0, "finish_reason": "tool_calls",
                     "message": {"role": "assistant", "content": None, "tool_calls": [call, bad]}}],
                     "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                               "prompt_tokens_details": {"cached_tokens": 8}}})
    msg = whole.generations[0].message
    assert isinstance(msg, AIMessage)
    assert msg.tool_calls == [{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}]
    assert [c["id"] for c in msg.invalid_tool_calls] == ["c2"]
    assert msg.usage_metadata == {"input_tokens": 10, "output_tokens": 4, "total_tokens": 14,
                                  "input_token_details": {"cache_read": 8}}
    assert msg.response_metadata["finish_reason"] == "tool_calls"

    deltas = [{"index": 0, "id": "c1", "type": "function", "function": {"name": "add", "arguments": ""}},
              {"index": 0, "function": {"arguments": '{"a": 1, '}}, {"index": 0, "function": {"arguments": '"b": 2}'}}]
    chunks = [_chunk({"id": "x", "model": "coder", "choices": [{"index": 0, "delta": {"tool_calls": [d]}}]})
              for d in deltas]
    total = chunks[0].message
    for c in chunks[1:]:
        total = total + c.message
    assert isinstance(total, AIMessageChunk)
    assert total.tool_calls == [{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}]


def test_ai_and_tool_messages_go_back_in_openai_form() -> None:
    ai = AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1}, "id": "c1"}])
    assert _to_wire(ai)["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert _to_wire(ToolMessage("2", tool_call_id="c1")) == {"role": "tool", "content": "2", "tool_call_id": "c1"}
    assert _to_wire(SystemMessage([{"type": "text", "text": "Be brief."}])) == {"role": "system", "content": "Be brief."}


def test_structured_output_asks_for_the_schema() -> None:
    from pydantic import BaseModel

    class Verdict(BaseModel):
        restart: bool

    llm = ChatAgentshare(base_url="http://127.0.0.1:9")
    by_schema = llm.with_structured_output(Verdict).first  # type: ignore[attr-defined]
    fmt = by_schema.kwargs["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"]["properties"] == {
        "restart": {"type": "boolean"}}
    by_tool = llm.with_structured_output(Verdict, method="function_calling").first  # type: ignore[attr-defined]
    assert by_tool.kwargs["tool_choice"] == {"type": "function", "function": {"name": "Verdict"}}
    assert by_tool.kwargs["parallel_tool_calls"] is False
