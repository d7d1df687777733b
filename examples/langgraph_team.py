"""A LangGraph team over ONE shared context: retrieval, then planning ∥ coding (fan-out), pinned
only while a node still reads it.

    python examples/langgraph_team.py                  # launches a local server (default model)
    python examples/langgraph_team.py --url http://127.0.0.1:8000

    START ─> context ─> retrieval ─┬─> planning ─┐ (fan_out: one Send each,   ─> END
            (prefill once, pinned)  └─> coding   ─┘  both decode from the pin)

The incident report is prefilled once; every agent decodes after it. A ``Retention`` counts the
nodes still to read it (retrieval is declared up front, the fan-out adds its two siblings) and
unpins it after the last, also when a node fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import anyio

from agentshare import Agent, AsyncClient, Sampling
from agentshare.langgraph import Retention, TeamState, agent_node, context_node, fan_out

DOC = Path(__file__).resolve().parent / "data" / "incident-report.md"


def build(client: AsyncClient, retention: Retention, max_tokens: int) -> Any:
    """The compiled graph: context -> retrieval -> (planning ∥ coding)."""
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
    g: Any = StateGraph(TeamState)  # the nodes are typed on Mapping, LangGraph types them on the state
    g.add_node("context", context_node(client, retention=retention))
    g.add_node("retrieval", agent_node(client, retrieval, retention=retention))
    g.add_node(team.name, team.node)
    g.add_edge(START, "context")
    g.add_edge("context", "retrieval")
    g.add_conditional_edges("retrieval", team.route, [team.name])
    g.add_edge(team.name, END)
    return g.compile()


async def run(client: AsyncClient, document: str, max_tokens: int) -> dict[str, Any]:
    """Run the team once; returns the final state (the context is unpinned by then)."""
    retention = Retention(client)
    async with retention:
        out: dict[str, Any] = await build(client, retention, max_tokens).ainvoke({"document": document})
    return out


async def main(args: argparse.Namespace) -> int:
    client = AsyncClient(args.url) if args.url else AsyncClient(server_args=["--log-level", "warning"])
    if not args.url:
        print("starting a local agentshare server ...")
    async with client:
        before = await client.metrics()
        out = await run(client, Path(args.doc).read_text(), args.max_tokens)
        spent = await client.metrics() - before
        pinned = (await client.metrics()).contexts_pinned
    for name in ("retrieval", "planning", "coding"):
        u = out["usage"][name]
        print(f"── {name}: {u.cached_tokens:,} prompt tokens from cache, {u.computed_tokens:,} computed")
        print(out["answers"][name].strip() or "(empty)")
    print(f"\nprefill tokens computed by the server: {spent.prefill_computed_tokens:,}, read from cache: "
          f"{spent.prefill_cached_tokens:,}; contexts still pinned: {pinned}")
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--doc", default=str(DOC), help="the shared context (a text file)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--url", default=None, help="use a running server instead of launching one")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(anyio.run(main, parse()))
