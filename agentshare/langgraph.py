"""LangGraph adapter: the agents of a graph run on ONE shared context, carried in the state.

The state carries the context's id (not its text), so every agent node decodes after the same
pinned prefill; answers merge into ``state["answers"]`` (parallel branches too)::

    START ─> context_node ─┬─> agent_node(retrieval) ─┐
            (prefill once) └─> agent_node(planning)  ─┴─> agent_node(coding) ─> release_node ─> END

This module does not import ``langgraph`` (install the extra: ``pip install 'agentshare[langgraph]'``);
the nodes are plain async callables of the state.

>>> from langgraph.graph import StateGraph, START, END
>>> g = (StateGraph(TeamState)
...      .add_node("context", context_node(client))
...      .add_node("planner", agent_node(client, Agent("planner", instruction="Plan it."), max_tokens=8))
...      .add_node("release", release_node(client))
...      .add_edge(START, "context").add_edge("context", "planner")
...      .add_edge("planner", "release").add_edge("release", END))
>>> out = await g.compile().ainvoke({"document": "Incident: the nightly export timed out twice."})
>>> sorted(out["answers"]), out["usage"]["planner"].cached_tokens
(['planner'], 32)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, TypedDict

from agentshare.agent import Agent, as_agent
from agentshare.client import AsyncClient
from agentshare.results import Usage

State = Mapping[str, Any]
Node = Callable[[State], Awaitable[dict[str, Any]]]


def merge(left: dict[str, Any] | None, right: dict[str, Any] | None) -> dict[str, Any]:
    """Reducer of ``answers`` and ``usage``: parallel agent nodes each add their own key.

    >>> merge({"a": 1}, {"b": 2})
    {'a': 1, 'b': 2}
    """
    return {**(left or {}), **(right or {})}


class TeamState(TypedDict, total=False):
    """A ready-made state: the document, the shared context's id, each agent's answer and usage.

    Any state with a ``context_id`` key (and ``answers``/``usage`` keys with the :func:`merge`
    reducer, when agents run in parallel) works as well.
    """

    document: str
    context_id: str
    answers: Annotated[dict[str, str], merge]
    usage: Annotated[dict[str, Usage], merge]


def context_node(client: AsyncClient, *, source: str = "document", ttl: float | None = None) -> Node:
    """A node that prefills ``state[source]`` once as a shared context and puts its id in the state."""

    async def node(state: State) -> dict[str, Any]:
        ctx = await client.context(state[source], ttl=ttl)
        return {"context_id": ctx.id}

    return node


def agent_node(client: AsyncClient, agent: Agent | str, *,
               prompt: str | Callable[[State], str] | None = None, share_answer: bool = False,
               **sampling: Any) -> Node:
    """A node that runs ``agent`` on the state's shared context.

    Args:
        client: the client whose server holds the context.
        agent: an :class:`Agent` (its instruction follows the context), or a server agent name.
        prompt: this node's prompt after the instruction: a string, or a function of the state
            (e.g. to pass on another agent's answer).
        share_answer: also append the answer to the shared context (``extend``), so later
            agents read it with only the new tokens prefilled. Use it on a sequential path
            only: parallel branches extending one context race.
        **sampling: sampling parameters over the agent's defaults.
    """
    a = as_agent(agent)

    async def node(state: State) -> dict[str, Any]:
        ctx = await client.attach(state["context_id"])
        text = prompt(state) if callable(prompt) else prompt
        answer = await ctx.generate(a, text, **sampling)
        if share_answer:
            await ctx.extend([{"role": "user", "content": a.turn(text)},
                              {"role": "assistant", "content": answer.text}])
        return {"answers": {a.name: answer.text}, "usage": {a.name: answer.usage}}

    return node


def release_node(client: AsyncClient) -> Node:
    """A node that unpins the state's shared context (it would expire after its TTL anyway)."""

    async def node(state: State) -> dict[str, Any]:
        ctx = await client.attach(state["context_id"])
        await ctx.release()
        return {}

    return node
