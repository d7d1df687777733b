"""LangGraph's prebuilt ReAct agent with ChatOpenAI and one Python tool against the real server
on the default model (SmolLM2-135M-Instruct), tool_choice auto."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from agentshare.local_server import LocalServer
from server.models.loader import default_model_dir
from tests.sdk.conftest import server_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Measured with the documented prompt: in auto mode SmolLM2-135M answers "The capital city of a
# country is Paris." in plain text (repeated to max_tokens) and never writes a call; with
# tool_choice "required" it calls capital_of({"country": "France"}), and after the result it
# answers from it. Strict: this test fails loudly once the model (or prompt) makes auto calls.
AUTO_DOES_NOT_CALL = pytest.mark.xfail(strict=True, reason="SmolLM2-135M does not call tools in auto mode")

CALLS: list[dict[str, str]] = []


@tool
def capital_of(country: str) -> str:
    """The capital city of a country."""
    CALLS.append({"country": country})
    return {"france": "Paris"}.get(country.strip().lower(), "unknown")


@pytest.fixture(scope="module")
def default_server() -> Iterator[str]:
    server = LocalServer(server_args(default_model_dir(progress=False)), startup_timeout=240)
    anyio.run(server.start)
    try:
        yield server.url
    finally:
        anyio.run(server.stop)


@AUTO_DOES_NOT_CALL
def test_react_agent_calls_the_tool_and_uses_its_result(default_server: str) -> None:
    llm = ChatOpenAI(base_url=default_server + "/v1", api_key="-", model="base",  # type: ignore[arg-type, call-arg]
                     temperature=0, max_tokens=64, max_retries=0)
    agent = create_react_agent(llm, [capital_of])
    out = agent.invoke({"messages": [("user", "What is the capital of France? Use the capital_of tool.")]},
                       {"recursion_limit": 6})
    msgs = out["messages"]
    calls = [c for m in msgs if isinstance(m, AIMessage) for c in m.tool_calls]
    assert calls and calls[0]["name"] == "capital_of" and isinstance(calls[0]["args"].get("country"), str), msgs
    assert any(isinstance(m, ToolMessage) and m.content == "Paris" for m in msgs), msgs
    assert "Paris" in str(msgs[-1].content), msgs[-1]
