"""LangGraph adapter: the agents of a graph run on ONE shared context, carried in the state.

The state carries the context's id (not its text), so every agent node decodes after the same
pinned prefill; answers merge into ``state["answers"]`` (parallel branches too)::

    START ─> context_node ─┬─> agent_node(retrieval) ─┐
            (prefill once) └─> agent_node(planning)  ─┴─> agent_node(coding) ─> release_node ─> END

Siblings reached by ``Send`` over one state: :func:`fan_out` (a routing function and the node
they run in). The pin's lifetime can follow the graph: a :class:`Retention` counts the nodes
still to read the context and unpins it after the last (instead of a ``release_node``).

This module does not import ``langgraph`` (install the extra: ``pip install 'agentshare[langgraph]'``);
the nodes are plain async callables of the state.

Examples:
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

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any, NamedTuple, Self, TypedDict

import anyio

from agentshare.agent import Agent, as_agent
from agentshare.client import AsyncClient
from agentshare.errors import NotFoundError
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


class Retention:
    """Keeps a graph's shared context pinned while nodes that read it are pending; unpins it
    when none remain (agent-step-aware retention, correct with parallel branches).

    It counts pending readers per context id:

    - every :func:`agent_node` made with ``retention=`` is a reader, and every sibling of a
      :func:`fan_out` made with it, all declared when the graph is built: each context
      :func:`context_node` creates with this retention starts with that many pending readers
      (so a reader that runs before a fan-out does not unpin it: the siblings are pending);
    - each reader takes one off after its generation ends (also on error or cancellation); the
      one that takes the last releases the pin.

    A run that fails (or skips a declared reader on a conditional path) leaves readers pending:
    run the graph inside ``async with retention:``, whose exit releases every pin still held.
    Each declared reader counts once per run (a reader node inside a loop: give it
    ``retention=None`` and release at the end instead).

    >>> retention = Retention(client)
    >>> ctx = await client.context("Shared notes: the export job runs at 02:00.")
    >>> retention.open(ctx.id, readers=2)
    >>> await retention.done(ctx.id), retention.pending(ctx.id)
    (False, 1)
    >>> await retention.done(ctx.id), retention.pending(ctx.id)   # the last reader unpins it
    (True, 0)
    """

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.later_readers = 0  # reader nodes (and fan-out siblings) declared with this retention
        self._pending: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<Retention {self._pending} pending, {self.later_readers} later readers per context>"

    def open(self, context_id: str, readers: int | None = None) -> None:
        """Start counting a new context's readers (default: the later readers declared)."""
        n = self.later_readers if readers is None else readers
        if n < 0:
            raise ValueError(f"Retention.open: readers must be >= 0, got {n}")
        self._pending[context_id] = self._pending.get(context_id, 0) + n

    def hold(self, context_id: str, readers: int = 1) -> None:
        """Add ``readers`` pending readers of a context this retention counts (readers known only at run time)."""
        if context_id not in self._pending:
            raise KeyError(f"Retention.hold: context {context_id!r} is not counted here; create it with "
                           "context_node(client, retention=...) or call retention.open(id) first")
        self._pending[context_id] += readers

    def pending(self, context_id: str) -> int:
        """Readers still pending on a context (0 once released or never counted)."""
        return self._pending.get(context_id, 0)

    @property
    def held(self) -> list[str]:
        """Ids of the contexts still pinned through this retention."""
        return list(self._pending)

    async def done(self, context_id: str) -> bool:
        """One reader finished; release the pin when it was the last. ``True`` if it released."""
        left = self._pending.get(context_id)
        if left is None:
            return False
        if left > 1:
            self._pending[context_id] = left - 1
            return False
        del self._pending[context_id]
        await self._release(context_id)
        return True

    async def release_all(self) -> int:
        """Release every context still held (after a failed run); returns how many."""
        ids, self._pending = list(self._pending), {}
        for context_id in ids:
            await self._release(context_id)
        return len(ids)

    async def _release(self, context_id: str) -> None:
        with anyio.CancelScope(shield=True):  # a cancelled branch still unpins
            try:
                ctx = await self.client.attach(context_id)
            except NotFoundError:
                return  # expired already
            await ctx.release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release_all()


def context_node(client: AsyncClient, *, source: str = "document", ttl: float | None = None,
                 retention: Retention | None = None) -> Node:
    """A node that prefills ``state[source]`` once as a shared context and puts its id in the state.

    With ``retention``, the context's pending readers are counted from here on (see
    :class:`Retention`).
    """

    async def node(state: State) -> dict[str, Any]:
        ctx = await client.context(state[source], ttl=ttl)
        if retention is not None:
            retention.open(ctx.id)
        return {"context_id": ctx.id}

    return node


def agent_node(client: AsyncClient, agent: Agent | str, *,
               prompt: str | Callable[[State], str] | None = None, share_answer: bool = False,
               retention: Retention | None = None, **sampling: Any) -> Node:
    """A node that runs ``agent`` on the state's shared context.

    Args:
        client: the client whose server holds the context.
        agent: an :class:`Agent` (its instruction follows the context), or a server agent name.
        prompt: this node's prompt after the instruction: a string, or a function of the state
            (e.g. to pass on another agent's answer).
        share_answer: also append the answer to the shared context (``extend``), so later
            agents read it with only the new tokens prefilled. Use it on a sequential path
            only: parallel branches extending one context race.
        retention: declare this node a later reader of the context: it stays pinned until this
            node has run (see :class:`Retention`).
        **sampling: sampling parameters over the agent's defaults.
    """
    a = as_agent(agent)
    if retention is not None:
        retention.later_readers += 1

    async def node(state: State) -> dict[str, Any]:
        return await _read(client, a, state, prompt, share_answer, retention, sampling)

    return node


async def _read(client: AsyncClient, a: Agent, state: State, prompt: str | Callable[[State], str] | None,
                share_answer: bool, retention: Retention | None, sampling: dict[str, Any]) -> dict[str, Any]:
    context_id = state["context_id"]
    try:
        ctx = await client.attach(context_id)
        text = prompt(state) if callable(prompt) else prompt
        answer = await ctx.generate(a, text, **sampling)
        if share_answer:
            await ctx.extend([{"role": "user", "content": a.turn(text)},
                              {"role": "assistant", "content": answer.text}])
    finally:
        if retention is not None:
            await retention.done(context_id)
    return {"answers": {a.name: answer.text}, "usage": {a.name: answer.usage}}


class FanOut(NamedTuple):
    """Sibling agents over one shared context: ``route`` for ``add_conditional_edges`` (one
    ``Send`` per agent), ``node`` the node they run in, added under ``name``."""

    route: Callable[[State], list[Any]]
    node: Node
    name: str


def fan_out(client: AsyncClient, agents: Sequence[Agent | str | tuple[Agent | str, str | Callable[[State], str]]],
            *, name: str = "team", retention: Retention | None = None, **sampling: Any) -> FanOut:
    """Sibling agent nodes reached by LangGraph's ``Send``: one prefill, the siblings decode from it.

    ``route(state)`` emits one ``Send(name, ...)`` per agent, each carrying the state and its
    ``context_id``; ``node`` runs that agent on the context and merges its answer and usage
    into the state (``TeamState``'s reducers). With ``retention``, each sibling is a declared
    reader, so the pin lasts until the last sibling (and every other reader declared) is done.

    Args:
        client: the client whose server holds the context.
        agents: :class:`Agent` objects, server agent names, or ``(agent, prompt)`` pairs (a
            prompt may be a function of the state).
        name: the node's name in the graph.
        retention: the graph's :class:`Retention` (the context made by a ``context_node`` of it).
        **sampling: applied to every sibling (over its own defaults).

    Examples:
        >>> from langgraph.graph import StateGraph, START, END
        >>> retention = Retention(client)
        >>> team = fan_out(client, [Agent("planner", instruction="Plan it."), Agent("coder", module="coder", instruction="Code it.")],
        ...                retention=retention, max_tokens=4)
        >>> g = (StateGraph(TeamState).add_node("context", context_node(client, retention=retention))
        ...      .add_node(team.name, team.node).add_edge(START, "context")
        ...      .add_conditional_edges("context", team.route, [team.name]).add_edge(team.name, END))
        >>> async with retention:
        ...     out = await g.compile().ainvoke({"document": "Incident: the nightly export timed out twice."})
        >>> sorted(out["answers"]), out["usage"]["coder"].cached_tokens, retention.held
        (['coder', 'planner'], 32, [])
    """
    pairs = [(as_agent(t[0]), t[1]) if isinstance(t, tuple) else (as_agent(t), None) for t in agents]
    if not pairs:
        raise ValueError("fan_out: give at least one agent")
    names = [a.name for a, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"fan_out: agent names must differ (their answers merge by name), got {names}")
    by_name = {a.name: (a, p) for a, p in pairs}
    if retention is not None:
        retention.later_readers += len(pairs)

    def route(state: State) -> list[Any]:
        from langgraph.types import Send

        if "context_id" not in state:
            raise KeyError("fan_out: the state has no context_id; route from a context_node")
        return [Send(name, {**state, _AGENT_KEY: a.name}) for a, _ in pairs]

    async def node(state: State) -> dict[str, Any]:
        a, prompt = by_name[state[_AGENT_KEY]]
        return await _read(client, a, state, prompt, False, retention, sampling)

    return FanOut(route, node, name)


_AGENT_KEY = "fan_out_agent"  # which sibling a Send is for


def release_node(client: AsyncClient) -> Node:
    """A node that unpins the state's shared context (it would expire after its TTL anyway)."""

    async def node(state: State) -> dict[str, Any]:
        ctx = await client.attach(state["context_id"])
        await ctx.release()
        return {}

    return node
