"""ChatAgentshare on a real server: a LangGraph graph streams its tokens; agents share a pinned context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip("langchain_core")
from langchain_core.messages import AIMessageChunk, HumanMessage, SystemMessage

from agentshare import AsyncClient
from agentshare.langchain import ChatAgentshare

pytestmark = pytest.mark.anyio

DOC = " ".join(f"Step {i}: rotate the key of service s{i} and restart its {i % 3 + 1} workers." for i in range(30))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # LangChain and LangGraph run on asyncio


async def test_langgraph_messages_stream_yields_our_tokens(server_url: str) -> None:
    pytest.importorskip("langgraph")
    from langgraph.graph import END, START, MessagesState, StateGraph

    llm = ChatAgentshare(base_url=server_url, agent="planner", max_tokens=6, temperature=0)

    async def call(state: MessagesState) -> dict[str, list[AIMessageChunk]]:
        total = None
        async for chunk in llm.astream(state["messages"]):
            total = chunk if total is None else total + chunk
        assert total is not None
        return {"messages": [total]}

    graph = StateGraph(MessagesState).add_node("agent", call).add_edge(START, "agent").add_edge("agent", END).compile()
    streamed: list[Any] = [(msg, meta) async for msg, meta in graph.astream({"messages": [HumanMessage("Plan the rollout.")]},
                                                                 stream_mode="messages")]
    tokens = [m for m, meta in streamed if isinstance(m, AIMessageChunk) and meta["langgraph_node"] == "agent"]
    text = "".join(str(m.content) for m in tokens)
    direct = await llm.ainvoke([HumanMessage("Plan the rollout.")])  # temperature 0: the same answer
    assert len([m for m in tokens if m.content]) > 1  # token by token, not one message at the end
    assert text == direct.content and text
    usage = [m.usage_metadata for m in tokens if m.usage_metadata]
    assert usage and usage[-1]["output_tokens"] == 6
    assert tokens[-1].response_metadata.get("model_name") == "planner" or any(
        m.response_metadata.get("model_name") == "planner" for m in tokens)


async def test_shared_context_is_pinned_once_and_read_by_every_agent(server_url: str) -> None:
    shared = [SystemMessage("You review runbooks."), HumanMessage(DOC)]
    team = [ChatAgentshare(base_url=server_url, agent=a, shared_context=shared, max_tokens=3) for a in ("coder", "planner")]
    try:
        first = await team[0].ainvoke("Which service is step 4?")
        second = team[1].invoke([HumanMessage("Plan the rotation.")])  # sync path, other agent
        async with httpx.AsyncClient(base_url=server_url) as http:
            info = (await http.get(f"/v1/contexts/{team[0].context_id}")).json()
        context_tokens = info["tokens"]
        assert context_tokens > 300
        pinned = context_tokens // 16 * 16  # full blocks
        for msg in (first, second):
            assert msg.usage_metadata is not None
            assert msg.usage_metadata["input_token_details"]["cache_read"] >= pinned
            assert msg.usage_metadata["input_tokens"] > context_tokens
        assert second.response_metadata["model_name"] == "planner"
        # a streamed call reads it too
        chunks = [c async for c in team[1].astream("And step 5?")]
        usage = [c.usage_metadata for c in chunks if c.usage_metadata]
        assert usage and usage[-1]["input_token_details"]["cache_read"] >= pinned
    finally:
        await team[0].aclose()
        team[1].close()
    async with httpx.AsyncClient(base_url=server_url) as http:
        assert (await http.get(f"/v1/contexts/{info['id']}")).status_code == 404  # released on close


async def test_a_client_gives_its_server(server_url: str) -> None:
    async with AsyncClient(server_url) as client:
        llm = ChatAgentshare(client=client, agent="base", max_tokens=2)
        msg = await llm.ainvoke("Hello")
        assert msg.usage_metadata is not None and msg.usage_metadata["output_tokens"] == 2
        assert llm.invoke("Hello").response_metadata["model_name"] == "base"


def test_an_unknown_agent_is_a_clear_error(server_url: str) -> None:
    from agentshare.errors import AgentshareError

    with pytest.raises(AgentshareError, match="nobody"):
        ChatAgentshare(base_url=server_url, agent="nobody").invoke("Hi")


def test_a_not_started_client_is_launched_by_a_sync_call(tiny_model_dir: Path) -> None:
    from tests.sdk.test_launch import gone, options

    client = AsyncClient(**options(tiny_model_dir))  # type: ignore[arg-type]
    llm = ChatAgentshare(client=client, max_tokens=2, shared_context="A context pinned on a launched server.")
    assert llm.invoke("Hi").usage_metadata["output_tokens"] == 2  # type: ignore[index]
    assert client.server is not None and client.server.process is not None and client.server.running
    pid = client.server.process.pid
    llm.close()  # unpins; the client's server is the client's to stop
    assert client.server.running and llm.context_id is None
    anyio.run(client.aclose)
    assert gone(pid)


def test_no_server_given_launches_one_and_close_stops_it(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.sdk.test_launch import gone

    monkeypatch.setenv("AGENTSHARE_MODEL", str(tiny_model_dir))
    llm = ChatAgentshare(max_tokens=2)
    assert llm.invoke("Hi").usage_metadata["output_tokens"] == 2  # type: ignore[index]
    assert llm._owned is not None and llm._owned.server is not None and llm._owned.server.process is not None
    pid = llm._owned.server.process.pid
    llm.close()
    assert gone(pid)
