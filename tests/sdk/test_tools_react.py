"""LangGraph's prebuilt ReAct agent with ``ChatOpenAI`` and one Python tool against the real server:
the shipped coding module (examples/modules/coding, trained on tool-chat rows that never list this
tool) calls it of its own accord (``tool_choice`` auto) and answers from its result. Its base (the
default model with the team's joint prefill patch) is the measured contrast: it answers in plain
text and never calls."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from agentshare.local_server import LocalServer

pytestmark = pytest.mark.timeout(300)

CODING = Path(__file__).resolve().parents[2] / "examples" / "modules" / "coding"
TEAM_BASE = CODING.parent / "team-base"  # a patch of the default model: the coding module's base
CALLS: list[dict[str, str]] = []
CAPITALS = {"france": "Paris", "peru": "Lima", "kenya": "Nairobi"}


@tool
def capital_of(country: str) -> str:
    """The capital city of a country."""
    CALLS.append({"country": country})
    return CAPITALS.get(country.strip().lower(), "unknown")


@pytest.fixture(scope="module")
def team_server(default_model: Path) -> Iterator[str]:
    """The shipped team's base in bf16 (the coding module's family) with the shipped coding module."""
    server = LocalServer(["--model", str(TEAM_BASE), "--dtype", "bfloat16",
                          "--kv-cache", "128MiB", "--threads", "2", "--log-level", "warning",
                          "--module", f"coding={CODING}"], startup_timeout=240)
    anyio.run(server.start)
    try:
        yield server.url
    finally:
        anyio.run(server.stop)


def react(url: str, model: str, question: str) -> list:
    llm = ChatOpenAI(base_url=url + "/v1", api_key="-", model=model,  # type: ignore[arg-type, call-arg]
                     temperature=0, max_tokens=64, max_retries=0)
    out = create_react_agent(llm, [capital_of]).invoke({"messages": [("user", question)]}, {"recursion_limit": 6})
    return out["messages"]


@pytest.mark.parametrize(("question", "country", "capital"), [
    ("What is the capital of France? Use the capital_of tool.", "france", "Paris"),
    ("What is the capital of Peru?", "peru", "Lima"),
])
def test_react_agent_calls_the_tool_and_uses_its_result(team_server: str, question: str, country: str,
                                                        capital: str) -> None:
    CALLS.clear()
    msgs = react(team_server, "coding", question)
    calls = [c for m in msgs if isinstance(m, AIMessage) for c in m.tool_calls]
    assert calls and calls[0]["name"] == "capital_of", msgs
    assert calls[0]["args"]["country"].strip().lower() == country, calls
    assert CALLS and CALLS[0]["country"].strip().lower() == country
    assert any(isinstance(m, ToolMessage) and m.content == capital for m in msgs), msgs
    assert isinstance(msgs[-1], AIMessage) and not msgs[-1].tool_calls and capital in str(msgs[-1].content), msgs[-1]


def test_the_base_model_answers_without_calling(team_server: str) -> None:
    """Measured contrast: the base (SmolLM2-135M with the team's prefill patch) does not call tools in
    auto mode."""
    msgs = react(team_server, "base", "What is the capital of France? Use the capital_of tool.")
    assert not [c for m in msgs if isinstance(m, AIMessage) for c in m.tool_calls], msgs
