"""The LangGraph team of ``langgraph_team.py`` through plain ``langchain_openai.ChatOpenAI``
pointed at an agentshare server: no agentshare SDK in the graph.

    python examples/langgraph_team_openai.py            # launches a local server (the team's base)
    python examples/langgraph_team_openai.py --url http://127.0.0.1:8000

The sharing comes from the server's prefix cache: a chat request's messages but the last are
its context, so every agent sends the report first and its own instruction last; the report's
blocks are computed by the first request and read from cache by the others (usage's
``cache_read``). Planning and coding run in parallel (one ``Send`` each). Then ``verify``:
LangGraph's prebuilt ReAct agent on ``ChatOpenAI`` with the ``deployed_version`` tool, answered
by the shipped coding module when the launched server serves it (as in ``langgraph_team.py``).
"""

from __future__ import annotations

import argparse
import operator
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any, TypedDict

import anyio

HERE = Path(__file__).resolve().parent
DOC = HERE / "data" / "incident-report.md"
CODING = HERE / "modules" / "coding"
TEAM_BASE = HERE / "modules" / "team-base"
"""The shipped modules' base: the default model with the team's joint prefill patch."""
DEPLOYED = {"ledger-writer": "4.18.2", "ledger-replica": "4.17.0", "checkout": "9.3.1"}
VERIFY = "Which version of ledger-writer is deployed now?"


def deployed_version(service: str) -> str:
    """The version of a service deployed in eu-west now."""
    return DEPLOYED.get(service.strip().lower(), "unknown service")

INSTRUCTIONS = {
    "retrieval": "You are the retrieval agent. Quote the report's root cause.",
    "planning": "You are the planning agent. Give the next three steps, one line each.",
    "coding": "You are the coding agent. Write the Python fix for extra_session().",
}


def _merge(left: dict[str, Any] | None, right: dict[str, Any] | None) -> dict[str, Any]:
    return {**(left or {}), **(right or {})}


class State(TypedDict, total=False):
    document: str
    agent: str  # the sibling a Send is for
    answers: Annotated[dict[str, str], _merge]
    cached: Annotated[dict[str, int], _merge]  # prompt tokens each agent read from the server's cache
    order: Annotated[list[str], operator.add]
    calls: list[str]  # the tool calls the verify step made


def build(llm: Any, tool_llm: Any = None) -> Any:
    """The compiled graph: retrieval -> (planning ∥ coding) -> verify, every call on ``llm`` (a
    ChatOpenAI), the verify step's on ``tool_llm`` (default ``llm``)."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool
    from langgraph.graph import END, START, StateGraph
    from langgraph.prebuilt import create_react_agent
    from langgraph.types import Send

    with warnings.catch_warnings():  # LangGraph 1.x points to langchain's create_agent (not a dependency)
        warnings.simplefilter("ignore", DeprecationWarning)
        react = create_react_agent(tool_llm or llm, [tool(deployed_version)])

    async def ask(state: State, name: str) -> dict[str, Any]:
        prompt = INSTRUCTIONS[name]
        if "retrieval" in state.get("answers", {}) and name != "retrieval":
            prompt += f"\nRoot cause: {state['answers']['retrieval']}"
        # the shared context first (messages[:-1]), this agent's turn last
        reply = await llm.ainvoke([HumanMessage(state["document"]), HumanMessage(prompt)])
        details = (reply.usage_metadata or {}).get("input_token_details", {})
        return {"answers": {name: str(reply.content)}, "cached": {name: int(details.get("cache_read", 0))},
                "order": [name]}

    async def retrieval(state: State) -> dict[str, Any]:
        return await ask(state, "retrieval")

    async def sibling(state: State) -> dict[str, Any]:
        return await ask(state, state["agent"])

    def fan_out(state: State) -> list[Any]:  # Send objects (LangGraph reads this hint)
        return [Send("sibling", {**state, "agent": name}) for name in ("planning", "coding")]

    async def verify(state: State) -> dict[str, Any]:
        out = await react.ainvoke({"messages": [("user", VERIFY)]}, {"recursion_limit": 6})
        msgs = out["messages"]
        calls = [f"{c['name']}({c['args']})" for m in msgs if isinstance(m, AIMessage) for c in m.tool_calls]
        return {"answers": {"verify": str(msgs[-1].content)}, "calls": calls, "order": ["verify"]}

    g: Any = StateGraph(State)
    g.add_node("retrieval", retrieval)
    g.add_node("sibling", sibling)
    g.add_node("verify", verify)
    g.add_edge(START, "retrieval")
    g.add_conditional_edges("retrieval", fan_out, ["sibling"])
    g.add_edge("sibling", "verify")
    g.add_edge("verify", END)
    return g.compile()


def chat_model(base_url: str, max_tokens: int, model: str = "base") -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{base_url}/v1", api_key="unused", model=model,  # type: ignore[arg-type]
                      temperature=0, max_tokens=max_tokens, max_retries=0)  # type: ignore[call-arg]


async def main(args: argparse.Namespace) -> int:
    from agentshare import AsyncClient

    # the SDK only launches (or probes) the server; the graph talks OpenAI to it
    if args.url:
        client = AsyncClient(args.url)
        tool_agent = args.tool_agent or "base"
    else:  # the shipped coding module is trained for the team's base (a patch of the default model), bf16
        shipped = (CODING / "adapter_model.safetensors").is_file()
        client = AsyncClient(server_args=["--log-level", "warning"], dtype="bfloat16",
                             model=str(TEAM_BASE) if shipped else None, modules={"coding": CODING} if shipped else None)
        tool_agent = args.tool_agent or ("coding" if shipped else "base")
    async with client:
        assert client.base_url is not None
        graph = build(chat_model(client.base_url, args.max_tokens), chat_model(client.base_url, 64, tool_agent))
        out = await graph.ainvoke({"document": Path(args.doc).read_text()})
    for name in ("retrieval", "planning", "coding"):
        print(f"── {name}: {out['cached'][name]:,} prompt tokens from the server's cache")
        print(out["answers"][name].strip() or "(empty)")
    print(f"── verify ({tool_agent}, tools): {VERIFY}")
    print(f"tool calls: {', '.join(out.get('calls', [])) or 'none'}")
    print(out["answers"]["verify"].strip() or "(empty)")
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
