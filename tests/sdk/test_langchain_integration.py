"""LangChain's standard integration suite for ChatAgentshare, against a real local server (the tiny
random model with two LoRA agents, tests/sdk/conftest.py).

The tiny model's weights are random: it answers with arbitrary tokens, so the tests that check
an answer's *content* (a tool's arguments, a sum, a stop sequence met) are marked xfail with
that reason; everything about the wire (invoke, stream, batch, usage, model override, message
histories) runs for real.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langchain_tests")
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from agentshare.langchain import ChatAgentshare

# LangChain's async tests carry no marker: run them on asyncio with anyio's plugin
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # LangChain runs on asyncio

TOOLS = "the tiny random model cannot pick the tool and fill in the arguments the test checks"
SCHEMA = ("constrained decoding keeps the JSON on the schema, but the tiny random model writes a string until "
          "max_tokens, so the answer ends before its required fields (or its values are not the ones checked)")
XFAIL = {  # test (with its parameters, where only some fail) -> why the tiny random model cannot pass it
    **dict.fromkeys(["test_tool_calling[model0]", "test_tool_calling[model1]", "test_tool_calling_async",
                     "test_bind_runnables_as_tools", "test_tool_choice", "test_tool_calling_with_no_arguments",
                     "test_agent_loop[model0]", "test_agent_loop[model1]", "test_unicode_tool_call_integration"], TOOLS),
    **dict.fromkeys(["test_structured_output[pydantic]", "test_structured_output_async[pydantic]",
                     "test_structured_output_pydantic_2_v1", "test_json_mode"], SCHEMA),
}


class TestChatAgentshareIntegration(ChatModelIntegrationTests):
    url = ""

    @pytest.fixture(autouse=True)
    def _server(self, server_url: str, request: pytest.FixtureRequest) -> None:
        type(self).url = server_url
        reason = XFAIL.get(request.node.name)
        if reason is not None:  # not strict: the random model's answers are sampled, one may pass by chance
            request.node.add_marker(pytest.mark.xfail(reason=reason, strict=False))

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """The second of two calls with one long system prompt: its blocks are read from the cache."""
        llm = ChatAgentshare(**self.chat_model_params, streaming=stream)
        messages = [SystemMessage(" ".join(f"Rule {i}: keep replica {i} in zone {i % 3}." for i in range(20))),
                    HumanMessage("Which zone holds replica 4?")]
        llm.invoke(messages)
        msg = llm.invoke(messages)
        assert msg.usage_metadata is not None
        assert msg.usage_metadata.get("input_token_details", {}).get("cache_read", 0) > 100
        return msg

    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatAgentshare

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "base", "base_url": self.url, "max_tokens": 16, "temperature": 0}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict[str, Any]:
        return {"method": "json_schema"}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> Any:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @property
    def model_override_value(self) -> str:
        return "coder"
