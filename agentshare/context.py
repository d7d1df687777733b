"""A shared context: prefilled once by the base model, pinned on the server, read by many agents.

::

    ctx = await client.context(document)            # one prefill, pinned for ttl seconds
          │
          ├── await ctx.generate(agent, prompt)     # one agent's turn after it
          ├── async for chunk in ctx.stream(...)    # the same, streamed
          ├── await ctx.fork([a, b, c])             # several agents at once, one prefill
          ├── await ctx.extend(messages)            # append (a ReAct observation): only new tokens prefill
          └── await ctx.release()                   # unpin now (or: async with ctx: ...)

Every agent's request is laid out as: the context, then the agent's turn, so the context's
blocks are served from the cache to every agent of the family; ``Answer.usage`` says how many
prompt tokens were cached vs computed.

>>> async with await client.context("Spec: square(x) returns x * x.") as ctx:
...     team = await ctx.fork([Agent("planner", instruction="Plan it."),
...                            (Agent("coder", module="coder"), "Write the function.")], max_tokens=8)
>>> [(answer.module, answer.usage.cached_tokens >= 32) for answer in team]  # a LoRA module reads the base's KV
[('base', True), ('coder', True)]
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, Self

import anyio

from agentshare import protocol
from agentshare.agent import Agent, as_agent
from agentshare.connection import Connection, content_body
from agentshare.errors import NotFoundError
from agentshare.results import Answer, Chunk, FinishReason, ForkResult, Timings, Usage

Task = Agent | str | tuple[Agent | str, str | None]


class SharedContext:
    """A context pinned on the server. Made by :meth:`AsyncClient.context` (or ``attach``) over
    the client's :class:`~agentshare.connection.Connection`; not built directly."""

    def __init__(self, connection: Connection, info: protocol.ContextInfo) -> None:
        self._conn = connection
        self.id = info.id
        self.released = False
        self._update(info)

    def _update(self, info: protocol.ContextInfo) -> None:
        self.kind: Literal["chat", "text"] = info.kind
        self.tokens = info.tokens  # tokens of the whole context
        self.computed_tokens = info.computed_tokens  # prefilled by the last create/extend
        self.cached_tokens = info.cached_tokens  # served from cache by the last create/extend
        self.pinned_tokens = info.pinned_tokens  # in full pinned blocks
        self.ttl = info.ttl
        self.expires_at = info.expires_at

    def __repr__(self) -> str:
        state = "released" if self.released else f"pinned {self.pinned_tokens}"
        return f"<SharedContext {self.id} {self.kind}, {self.tokens} tokens, {state}>"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.release()

    # ---- one agent -----------------------------------------------------------------------

    async def generate(self, agent: Agent | str, prompt: str | None = None, **sampling: Any) -> Answer:
        """One agent's answer after this context.

        Args:
            agent: an :class:`Agent`, or the name of a server agent (module).
            prompt: this call's prompt, placed after the agent's instruction.
            **sampling: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``
                (override the agent's defaults).
        """
        a = as_agent(agent)
        start = time.perf_counter()
        ttft: float | None = None
        parts: list[str] = []
        ids: list[int] = []
        finish: FinishReason | None = None
        usage: Usage | None = None
        gen_id = ""
        async for chunk, gid in self._chunks(a, prompt, sampling):
            gen_id = gid
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - start
            parts.append(chunk.text)
            ids.extend(chunk.token_ids)
            finish = chunk.finish_reason or finish
            usage = chunk.usage or usage
        if usage is None or finish is None:
            raise RuntimeError("the server's stream ended without a finish_reason and usage")
        return Answer(agent=a.name, module=a.module, text="".join(parts), finish_reason=finish, usage=usage,
                      timings=Timings(ttft=ttft, total=time.perf_counter() - start), id=gen_id,
                      context_id=self.id, token_ids=tuple(ids))

    async def stream(self, agent: Agent | str, prompt: str | None = None, **sampling: Any) -> AsyncIterator[Chunk]:
        """Stream one agent's answer: :class:`Chunk` objects, the last with ``finish_reason`` and
        ``usage``. Stopping early: wrap in ``contextlib.aclosing`` so the request is cancelled."""
        async for chunk, _ in self._chunks(as_agent(agent), prompt, sampling):
            yield chunk

    async def _chunks(self, a: Agent, prompt: str | None, sampling: dict[str, Any]) -> AsyncIterator[tuple[Chunk, str]]:
        body: dict[str, Any] = {"agent": a.module, **a.sampling.merged(**sampling).wire(), "stream": True}
        turn = a.turn(prompt)
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": turn}]
        else:
            body["text"] = turn
        async for event in self._conn.stream(f"/v1/contexts/{self.id}/generate", body):
            c = protocol.GenerationChunk.model_validate(event)
            yield Chunk(agent=a.name, text=c.text, token_ids=tuple(c.token_ids), finish_reason=c.finish_reason,
                        usage=None if c.usage is None else Usage.of(c.usage)), c.id

    # ---- a team ----------------------------------------------------------------------------

    async def fork(self, tasks: Sequence[Task], **sampling: Any) -> ForkResult:
        """Run several agents concurrently after this context: one prefill, N decodes.

        Args:
            tasks: :class:`Agent` objects (each with its instruction), server agent names, or
                ``(agent, prompt)`` pairs.
            **sampling: applied to every agent (over its own defaults).
        """
        pairs = [(as_agent(t[0]), t[1]) if isinstance(t, tuple) else (as_agent(t), None) for t in tasks]
        if not pairs:
            raise ValueError("fork: give at least one agent")
        for a, prompt in pairs:
            a.turn(prompt)  # refuse an empty turn before anything starts
        answers: list[Answer | None] = [None] * len(pairs)

        async def run(i: int, a: Agent, prompt: str | None) -> None:
            answers[i] = await self.generate(a, prompt, **sampling)

        start = time.perf_counter()
        try:
            async with anyio.create_task_group() as tg:
                for i, (a, prompt) in enumerate(pairs):
                    tg.start_soon(run, i, a, prompt)
        except BaseExceptionGroup as group:  # one agent failed (the others were cancelled): raise its error
            errors = [e for e in _leaves(group) if isinstance(e, Exception)]
            if not errors:
                raise
            raise errors[0] from group
        done = tuple(a for a in answers if a is not None)
        assert len(done) == len(pairs)
        return ForkResult(done, wall=time.perf_counter() - start, context_tokens=self.tokens)

    # ---- lifetime --------------------------------------------------------------------------

    async def extend(self, messages: str | Sequence[Any], *, ttl: float | None = None) -> SharedContext:
        """Append to this context (same id); only the new tokens are prefilled. Returns ``self``.

        On a chat context a string is one user message; on a text context, plain text.
        """
        body = content_body(messages, text_kind=self.kind == "text")
        if ttl is not None:
            body["ttl"] = ttl
        info = protocol.ContextInfo.model_validate(
            await self._conn.request("POST", f"/v1/contexts/{self.id}/extend", body))
        self._update(info)
        return self

    async def refresh(self) -> SharedContext:
        """Re-read this context's figures from the server."""
        self._update(protocol.ContextInfo.model_validate(await self._conn.request("GET", f"/v1/contexts/{self.id}")))
        return self

    async def release(self) -> bool:
        """Unpin now. Idempotent; ``False`` if it had already expired or been released."""
        if self.released:
            return False
        self.released = True
        if self._conn.closed:  # a launched server is gone with its client; a remote pin expires
            return False
        try:
            out = await self._conn.request("DELETE", f"/v1/contexts/{self.id}")
        except NotFoundError:
            return False
        return bool(protocol.ContextReleased.model_validate(out).released)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out
