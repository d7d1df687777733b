"""A LangGraph StateGraph of three agent nodes runs on ONE shared context (real server)."""

from __future__ import annotations

import pytest

from agentshare import Agent, AsyncClient
from agentshare.langgraph import TeamState, agent_node, context_node, release_node

pytest.importorskip("langgraph")
from langgraph.graph import END, START, StateGraph

# LangGraph runs its graphs on asyncio only
pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]

DOC = " ".join(f"Step {i}: rotate the key of service s{i} and restart its {i % 3 + 1} workers." for i in range(30))


async def test_graph_of_agents_shares_one_prefill(server_url: str, anyio_backend: str) -> None:
    async with AsyncClient(server_url) as client:
        g = StateGraph(TeamState)
        g.add_node("context", context_node(client))
        g.add_node("retrieval", agent_node(client, Agent("retrieval", instruction="Which service is step 4?"),
                                           max_tokens=4, temperature=0))
        g.add_node("planning", agent_node(client, Agent("planning", module="planner", instruction="Plan it."),
                                          max_tokens=4, temperature=0))
        g.add_node("coding", agent_node(
            client, Agent("coding", module="coder", instruction="Write the script."), share_answer=True,
            prompt=lambda s: f"The plan: {s['answers']['planning']}", max_tokens=4, temperature=0))
        g.add_node("release", release_node(client))
        g.add_edge(START, "context")
        g.add_edge("context", "retrieval")
        g.add_edge("context", "planning")  # retrieval and planning run in parallel
        g.add_edge(["retrieval", "planning"], "coding")
        g.add_edge("coding", "release")
        g.add_edge("release", END)

        before = await client.metrics()
        out = await g.compile().ainvoke({"document": f"[{anyio_backend}] {DOC}"})
        spent = await client.metrics() - before

    assert set(out["answers"]) == {"retrieval", "planning", "coding"}
    assert all(isinstance(t, str) and t for t in out["answers"].values())
    turns = sum(u.computed_tokens for u in out["usage"].values())
    context_tokens = min(u.cached_tokens for u in out["usage"].values())
    assert context_tokens > 300
    # one prefill of the context (less its cached template block), then only the agents' turns
    # and the coder's shared answer (the extend)
    assert spent.prefill_computed_tokens < context_tokens + turns + 64
    assert spent.contexts_pinned == 0  # the release node unpinned it
