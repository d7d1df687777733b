"""LangChain's standard unit suite for ChatAgentshare (no server: construction, binding, serialization)."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")
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
