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


async def test_fan_out_shares_one_prefill_and_retention_follows_the_readers(server_url: str, anyio_backend: str) -> None:
    from agentshare.errors import NotFoundError
    from agentshare.langgraph import Retention, fan_out

    async with AsyncClient(server_url) as client:
        retention = Retention(client)
        team = fan_out(client, [Agent(n, module=m, instruction=f"Do the {n}.") for n, m in
                                (("retrieval", "base"), ("planning", "planner"), ("coding", "coder"))],
                       retention=retention, max_tokens=4, temperature=0)
        seen: dict[str, object] = {}

        async def check(state: dict) -> dict:  # after the fan-out, before the later reader
            seen["pending"] = retention.pending(state["context_id"])
            seen["pinned"] = (await client.attach(state["context_id"])).pinned_tokens
            return {}

        g = StateGraph(TeamState)
        g.add_node("context", context_node(client, retention=retention))
        g.add_node(team.name, team.node)
        g.add_node("check", check)
        g.add_node("review", agent_node(client, Agent("review", instruction="Review it."), retention=retention,
                                        max_tokens=4, temperature=0))
        g.add_edge(START, "context")
        g.add_conditional_edges("context", team.route, [team.name])
        g.add_edge(team.name, "check")
        g.add_edge("check", "review")
        g.add_edge("review", END)

        before = await client.metrics()
        async with retention:
            out = await g.compile().ainvoke({"document": f"[fan-out {anyio_backend}] {DOC}"})
            assert retention.held == []  # the last reader (review) released it, not the exit
        spent = await client.metrics() - before
        with pytest.raises(NotFoundError):
            await client.attach(out["context_id"])

    assert set(out["answers"]) == {"retrieval", "planning", "coding", "review"}
    assert seen["pending"] == 1 and isinstance(seen["pinned"], int) and seen["pinned"] > 300
    context_tokens = min(u.cached_tokens for u in out["usage"].values())
    assert context_tokens > 300  # every sibling (and the reviewer) read the shared context from cache
    turns = sum(u.computed_tokens for u in out["usage"].values())
    assert spent.prefill_computed_tokens < context_tokens + turns + 64  # the context prefilled once


async def test_retention_releases_the_pin_when_a_sibling_fails(server_url: str, anyio_backend: str) -> None:
    from agentshare.errors import NotFoundError
    from agentshare.langgraph import Retention, fan_out

    async with AsyncClient(server_url) as client:
        retention = Retention(client)
        team = fan_out(client, [Agent("ok", instruction="Say hi."),
                                Agent("broken", module="no-such-agent", instruction="Say hi.")],
                       retention=retention, max_tokens=2)
        g = StateGraph(TeamState)
        g.add_node("context", context_node(client, retention=retention))
        g.add_node(team.name, team.node)
        g.add_node("review", agent_node(client, Agent("review", instruction="Review."), retention=retention,
                                        max_tokens=2))
        g.add_edge(START, "context")
        g.add_conditional_edges("context", team.route, [team.name])
        g.add_edge(team.name, "review")
        g.add_edge("review", END)
        held: list[str] = []
        with pytest.raises(Exception, match="no-such-agent"):
            async with retention:
                try:
                    await g.compile().ainvoke({"document": f"[failing {anyio_backend}] {DOC}"})
                finally:
                    held = retention.held  # the reviewer never ran: its read is still pending
        assert len(held) == 1 and retention.held == []
        with pytest.raises(NotFoundError):
            await client.attach(held[0])


async def test_openai_example_graph_reads_the_report_from_the_prefix_cache(server_url: str, anyio_backend: str) -> None:
    """examples/langgraph_team_openai.py's graph, through plain ChatOpenAI, on the test server."""
    import importlib.util
    import sys
    from pathlib import Path

    pytest.importorskip("langchain_openai")
    path = Path(__file__).resolve().parents[2] / "examples" / "langgraph_team_openai.py"
    spec = importlib.util.spec_from_file_location("langgraph_team_openai", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # LangGraph resolves the state's hints through the module
    spec.loader.exec_module(example)
    out = await example.build(example.chat_model(server_url, max_tokens=4)).ainvoke(
        {"document": f"[openai {anyio_backend}] {DOC}"})
    assert out["order"][0] == "retrieval" and sorted(out["order"][1:3]) == ["coding", "planning"]
    assert out["order"][3:] == ["verify"] and isinstance(out["calls"], list)
    assert out["cached"]["retrieval"] < 100  # the first request computed the report
    assert min(out["cached"]["planning"], out["cached"]["coding"]) > 300  # the siblings read it from cache


async def test_sdk_example_graph_runs_and_leaves_no_pin(server_url: str, anyio_backend: str) -> None:
    """examples/langgraph_team.py's graph on the test server: every agent reads the one context."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "langgraph_team.py"
    spec = importlib.util.spec_from_file_location("langgraph_team", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    async with AsyncClient(server_url) as client:
        out = await example.run(client, f"[example {anyio_backend}] {DOC}", 4)
        from agentshare.errors import NotFoundError

        with pytest.raises(NotFoundError):
            await client.attach(out["context_id"])
    assert set(out["answers"]) == {"retrieval", "planning", "coding", "verify"}  # verify: the tool step
    assert isinstance(out["calls"], list)
    assert min(u.cached_tokens for u in out["usage"].values()) > 300
