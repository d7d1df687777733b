"""A LangGraph team over ONE shared context: retrieval, then planning ∥ coding (fan-out), pinned
only while a node still reads it; then the coding agent checks the deployment with a tool.

    python examples/langgraph_team.py                  # launches a local server (the shipped
                                                       # team's base and its coding module)
    python examples/langgraph_team.py --url http://127.0.0.1:8000 --tool-agent coding

    START ─> context ─> retrieval ─┬─> planning ─┐ (fan_out: one Send each,   ─> verify ─> END
            (prefill once, pinned)  └─> coding   ─┘  both decode from the pin)   (tools)

The incident report is prefilled once; every agent decodes after it. A ``Retention`` counts the
nodes still to read it (retrieval is declared up front, the fan-out adds its two siblings) and
unpins it after the last, also when a node fails.

``verify`` is LangGraph's prebuilt ReAct agent on :class:`agentshare.langchain.ChatAgentshare`
with one Python tool, ``deployed_version``: the shipped coding module (examples/modules/coding,
trained to call tools in the server's tool format) calls it of its own accord and answers from
its result. The base model does not call tools (docs/tools.md).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import anyio

from agentshare import Agent, AsyncClient, Sampling
from agentshare.langgraph import Retention, TeamState, agent_node, context_node, fan_out

HERE = Path(__file__).resolve().parent
DOC = HERE / "data" / "incident-report.md"
CODING = HERE / "modules" / "coding"
TEAM_BASE = HERE / "modules" / "team-base"
"""The shipped modules' base: the default model with the team's joint prefill patch."""
DEPLOYED = {"ledger-writer": "4.18.2", "ledger-replica": "4.17.0", "checkout": "9.3.1"}
VERIFY = "Which version of ledger-writer is deployed now?"


class State(TeamState, total=False):
    calls: list[str]  # the tool calls the verify step made


def deployed_version(service: str) -> str:
    """The version of a service deployed in eu-west now."""
    return DEPLOYED.get(service.strip().lower(), "unknown service")


def verify_node(client: AsyncClient, agent: str, max_tokens: int) -> Any:
    """The ReAct step: ``agent`` answers :data:`VERIFY`, calling ``deployed_version`` if it will."""
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    from agentshare.langchain import ChatAgentshare

    async def verify(state: State) -> dict[str, Any]:
        llm = ChatAgentshare(client=client, model=agent, temperature=0, max_tokens=max_tokens)
        with warnings.catch_warnings():  # LangGraph 1.x points to langchain's create_agent (not a dependency)
            warnings.simplefilter("ignore", DeprecationWarning)
            react = create_react_agent(llm, [tool(deployed_version)])
        out = await react.ainvoke({"messages": [("user", VERIFY)]}, {"recursion_limit": 6})
        msgs = out["messages"]
        calls = [f"{c['name']}({c['args']})" for m in msgs if isinstance(m, AIMessage) for c in m.tool_calls]
        return {"answers": {"verify": str(msgs[-1].content)}, "calls": calls}

    return verify


def build(client: AsyncClient, retention: Retention, max_tokens: int, tool_agent: str = "base") -> Any:
    """The compiled graph: context -> retrieval -> (planning ∥ coding) -> verify (``tool_agent``)."""
    from langgraph.graph import END, START, StateGraph

    s = Sampling(max_tokens=max_tokens, temperature=0)
    retrieval = Agent("retrieval", instruction="You are the retrieval agent. Quote the report's root cause.",
                      sampling=s)
    planning = Agent("planning", instruction="You are the planning agent. Give the next three steps, one line each.",
                     sampling=s)
    coding = Agent("coding", instruction="You are the coding agent. Write the Python fix for extra_session().",
                   sampling=s)
    team = fan_out(client, [(planning, lambda st: f"Root cause: {st['answers']['retrieval']}"),
                            (coding, lambda st: f"Root cause: {st['answers']['retrieval']}")],
                   retention=retention)
    g: Any = StateGraph(State)  # the nodes are typed on Mapping, LangGraph types them on the state
    g.add_node("context", context_node(client, retention=retention))
    g.add_node("retrieval", agent_node(client, retrieval, retention=retention))
    g.add_node(team.name, team.node)
    g.add_node("verify", verify_node(client, tool_agent, max_tokens))
    g.add_edge(START, "context")
    g.add_edge("context", "retrieval")
    g.add_conditional_edges("retrieval", team.route, [team.name])
    g.add_edge(team.name, "verify")
    g.add_edge("verify", END)
    return g.compile()


async def run(client: AsyncClient, document: str, max_tokens: int, tool_agent: str = "base") -> dict[str, Any]:
    """Run the team once; returns the final state (the context is unpinned by then)."""
    retention = Retention(client)
    async with retention:
        out: dict[str, Any] = await build(client, retention, max_tokens, tool_agent).ainvoke({"document": document})
    return out


async def main(args: argparse.Namespace) -> int:
    if args.url:
        client = AsyncClient(args.url)
        tool_agent = args.tool_agent or "base"
    else:  # the shipped coding module is trained for the team's base (a patch of the default model), bf16
        print("starting a local agentshare server ...")
        shipped = (CODING / "adapter_model.safetensors").is_file()
        client = AsyncClient(server_args=["--log-level", "warning"], dtype="bfloat16",
                             model=str(TEAM_BASE) if shipped else None, modules={"coding": CODING} if shipped else None)
        tool_agent = args.tool_agent or ("coding" if shipped else "base")
    async with client:
        before = await client.metrics()
        out = await run(client, Path(args.doc).read_text(), args.max_tokens, tool_agent)
        spent = await client.metrics() - before
        pinned = (await client.metrics()).contexts_pinned
    for name in ("retrieval", "planning", "coding"):
        u = out["usage"][name]
        print(f"── {name}: {u.cached_tokens:,} prompt tokens from cache, {u.computed_tokens:,} computed")
        print(out["answers"][name].strip() or "(empty)")
    print(f"── verify ({tool_agent}, tools): {VERIFY}")
    print(f"tool calls: {', '.join(out.get('calls', [])) or 'none'}")
    print(out["answers"]["verify"].strip() or "(empty)")
    print(f"\nprefill tokens computed by the server: {spent.prefill_computed_tokens:,}, read from cache: "
          f"{spent.prefill_cached_tokens:,}; contexts still pinned: {pinned}")
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--doc", default=str(DOC), help="the shared context (a text file)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--url", default=None, help="use a running server instead of launching one")
    p.add_argument("--tool-agent", default=None,
                   help="the agent of the verify step (default: coding when the shipped module is served, else base)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(anyio.run(main, parse()))
