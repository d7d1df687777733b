"""The async client: connects to a server, or launches a local one and stops it when closed.

::

    AsyncClient()                      no URL: start `agentshare serve` on a free loopback port
      │                                (the embedded default), wait for /health, stop it on aclose()
    AsyncClient("http://host:8000")    connect to a running server
      │
      ├── await client.context(doc)    -> SharedContext (prefilled once, pinned)
      ├── await client.attach(id)      -> SharedContext (an existing one, by id)
      ├── await client.agents()        -> Team [ServedAgent]: what the server serves, what sharing costs
      ├── await client.explain(...)    -> CacheExplanation (how much of a request the cache serves)
      └── await client.metrics()       -> ServerMetrics  (prefill tokens computed vs cached)

It works under asyncio and trio (anyio), and inside a running loop (Jupyter's top-level
``await``). The server is started on first use or on ``async with``; ``aclose()`` stops it;
it is also stopped at interpreter exit, and it dies with its parent process.

>>> async with AsyncClient(url) as client:        # AsyncClient(): launch a local server instead
...     ctx = await client.context("The service keeps one replica per zone ...")
...     answer = await ctx.generate("base", "How many replicas per zone?", max_tokens=16)
>>> answer.usage.cached_tokens, answer.usage.computed_tokens    # the context's blocks were cached
(32, 17)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from typing import Any, Literal, Self

import httpx

from agentshare import protocol
from agentshare.agent import Agent, as_agent
from agentshare.connection import Connection, content_body
from agentshare.context import SharedContext
from agentshare.local_server import LocalServer
from agentshare.metrics import ServerMetrics


@dataclass(frozen=True, slots=True)
class ServedAgent:
    """An agent the server serves: its decode module's kind and the prefill it shares."""

    name: str
    kind: str  # the decode-module kind: "base", "lora", "full", or any kind the server registers
    family: str | None  # None: a private prefill (no manifest for this family); ``reason`` says why
    shares_prefill: bool
    placement: Literal["turn", "header"]
    reason: str = ""
    recompute_layers: int = 0
    """Top layers it recomputes over the shared prefix (0: it reads the base's KV of every layer)."""
    fidelity: protocol.Fidelity | None = None
    """What sharing costs it, as ``agentshare finetune --fidelity`` measured when it was trained
    (None: not measured)."""

    @property
    def sharing_cost(self) -> str:
        """One line: what sharing costs this agent, as measured; or why nothing is known.

        >>> ServedAgent("base", "base", "f" * 64, True, "turn").sharing_cost
        'the base model: nothing to compare'
        """
        f = self.fidelity
        if f is not None:
            unit = "%" if f.metric == "exact" else "% of tokens"
            return (f"{100 * f.shared:.1f} {unit} shared vs {100 * f.own:.1f} {unit} own prefill: "
                    f"{-f.gap_points:+.1f} points [{-f.ci_points[1]:+.1f}, {-f.ci_points[0]:+.1f}], "
                    f"k = {f.recompute_layers} of {f.layers}, {f.rows.get('held_out', 0)} held-out rows")
        if self.kind == "base":
            return "the base model: nothing to compare"
        if not self.shares_prefill:
            return "private prefill: sharing costs nothing, and saves nothing"
        return "not measured (train it with agentshare finetune --fidelity POINTS)"


class Team(list[ServedAgent]):
    """The agents a server serves (``AsyncClient.agents()``): a list, shown as a table of what
    each shares and what sharing costs it.

    >>> print(Team([ServedAgent("base", "base", "f" * 64, True, "turn")]).table())
    agent  kind  shares  k  what sharing costs
    base   base  yes     0  the base model: nothing to compare
    """

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        return [(a.name, a.kind, "yes" if a.shares_prefill else "no", str(a.recompute_layers), a.sharing_cost)
                for a in self]

    def table(self) -> str:
        head = ("agent", "kind", "shares", "k", "what sharing costs")
        rows = [head, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
                         for r in rows)

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        from html import escape

        head = "".join(f"<th>{h}</th>" for h in ("agent", "kind", "shares", "k", "what sharing costs"))
        body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in self.rows())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


@dataclass(frozen=True, slots=True)
class CacheExplanation:
    """How much of a request the cache would serve now, and where it stops."""

    agent: str
    shares_prefill: bool
    prompt_tokens: int
    cached_tokens: int
    block_size: int
    blocks: int
    cached_blocks: int
    first_miss_block: int | None
    first_miss_token: int | None
    recompute_layers: int = 0
    """A layer-split agent's recomputed top layers (0: it reads the base's KV of every layer)."""
    fill_blocks: int = 0
    """Of the missed blocks, those a layer-split agent would fill from the shared prefill (its
    top layers recomputed, the rest read)."""


class AsyncClient:
    """A client of one agentshare server.

    Args:
        base_url: the server (``http://127.0.0.1:8000``); ``None`` launches a local one.
        api_key: sent as ``Authorization: Bearer``; a launched server accepts it.
        model: base model directory of a launched server (default: SmolLM2-135M-Instruct).
        modules: ``{agent name: module directory}`` served by a launched server.
        dtype: ``auto``, ``float32`` or ``bfloat16`` (launched server).
        threads: torch threads of a launched server.
        kv_cache: KV pool size of a launched server (``"512MiB"``).
        server_args: more ``agentshare serve`` options for a launched server.
        startup_timeout: seconds a launched server may take to become healthy.
        timeout: seconds a request may take (generation included).
        transport: an ``httpx`` transport (e.g. ``httpx.ASGITransport(app)`` for in-process tests).
    """

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 model: str | PathLike[str] | None = None,
                 modules: Mapping[str, str | PathLike[str]] | None = None, dtype: str = "auto",
                 threads: int | None = None, kv_cache: str | None = None, server_args: Sequence[str] = (),
                 startup_timeout: float = 180.0, timeout: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.api_key = api_key
        self.timeout = timeout
        self.server: LocalServer | None = None
        if base_url is None and transport is None:
            args = ["--dtype", dtype]
            if model is not None:
                args += ["--model", str(model)]
            for name, path in (modules or {}).items():
                args += ["--module", f"{name}={path}"]
            if threads is not None:
                args += ["--threads", str(threads)]
            if kv_cache is not None:
                args += ["--kv-cache", kv_cache]
            if api_key is not None:
                args += ["--api-key", api_key]
            self.server = LocalServer([*args, *server_args], startup_timeout=startup_timeout)
        elif model is not None or modules:
            raise ValueError("model= and modules= configure a launched server; with a base_url the server "
                             "serves what it was started with")
        self._conn = Connection(base_url, api_key=api_key, timeout=timeout, transport=transport,
                                server=self.server)

    @property
    def base_url(self) -> str | None:
        """The server's URL (a launched server's once started)."""
        return self._conn.base_url

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called (a closed client refuses every call)."""
        return self._conn.closed

    def __repr__(self) -> str:
        how = "launched" if self.server is not None else "connected"
        return f"<AsyncClient {how} {self.base_url}{' closed' if self.closed else ''}>"

    # ---- lifetime ----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Launch the local server (if any) and open the connection; done on first use anyway."""
        await self._conn.open()

    async def aclose(self) -> None:
        """Close the connection and stop a launched server (waits until its process is gone)."""
        await self._conn.aclose()

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return await self._conn.request(method, path, body)

    # ---- the API -----------------------------------------------------------------------------

    async def context(self, content: str | Sequence[Any] | None = None, *, text: str | None = None,
                      ttl: float | None = None) -> SharedContext:
        """Prefill a shared context once and pin it for ``ttl`` seconds (server default: 600).

        Args:
            content: chat messages (``[{"role": "user", "content": ...}, ...]``), or a string
                (one user message).
            text: instead of ``content``, plain text without a chat template (agents' turns
                are then plain text too).
            ttl: seconds the server keeps it pinned; release it earlier with ``release()`` or
                ``async with``.
        """
        if (content is None) == (text is None):
            raise ValueError("give the context as content (messages or a string) or as text=, not both")
        body = content_body(text, text_kind=True) if text is not None else content_body(content or "")
        if ttl is not None:
            body["ttl"] = ttl
        info = protocol.ContextInfo.model_validate(await self._request("POST", "/v1/contexts", body))
        return SharedContext(self._conn, info)

    async def attach(self, context_id: str) -> SharedContext:
        """A handle on an existing context by id (e.g. one carried in a LangGraph state)."""
        info = protocol.ContextInfo.model_validate(await self._request("GET", f"/v1/contexts/{context_id}"))
        return SharedContext(self._conn, info)

    async def agents(self) -> Team:
        """The agents (decode modules) the server serves, whether each shares the prefill, and
        what sharing costs it where that was measured (``print(team)`` shows the table)."""
        listing = protocol.AgentList.model_validate(await self._request("GET", "/v1/agents"))
        return Team(ServedAgent(a.name, a.kind, a.family, a.shares_prefill, a.placement, a.reason,
                                a.recompute_layers, a.fidelity) for a in listing.data)

    async def explain(self, agent: Agent | str, messages: Sequence[Any] | None = None, *,
                      context: SharedContext | None = None, prompt: str | None = None) -> CacheExplanation:
        """How much of a request the cache would serve now (a pure query).

        With ``context``: the agent's turn (its instruction and ``prompt``) after that context.
        Otherwise ``messages`` laid out as a chat request (context = all but the last), or
        ``prompt`` as a plain-text completion.
        """
        a = as_agent(agent)
        body: dict[str, Any] = {"agent": a.module}
        if context is not None:
            body["context_id"] = context.id
            turn = a.turn(prompt)
            body.update({"text": turn} if context.kind == "text" else
                        {"messages": [{"role": "user", "content": turn}]})
        elif messages is not None:
            body.update(content_body(messages))
        elif prompt is not None:
            body["prompt"] = prompt
        else:
            raise ValueError("explain: give messages, a prompt, or a context")
        e = protocol.Explanation.model_validate(await self._request("POST", "/v1/explain", body))
        return CacheExplanation(e.agent, e.shares_prefill, e.prompt_tokens, e.cached_tokens, e.block_size,
                                e.blocks, e.cached_blocks, e.first_miss_block, e.first_miss_token,
                                e.recompute_layers, e.fill_blocks)

    async def metrics(self) -> ServerMetrics:
        """The server's counters now (prefill tokens computed vs cached since it started)."""
        return ServerMetrics.parse(str(await self._request("GET", "/metrics")))

    async def health(self) -> protocol.Health:
        return protocol.Health.model_validate(await self._request("GET", "/health"))

