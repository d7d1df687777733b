"""One request's events from its decode worker, as the router streams them to the API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from server.cluster.members import Member, WorkerDown
from server.cluster.messages import Event
from server.cluster.metrics import RouterStats
from server.engine.sequence import FinishReason, TokenEvent


class ClusterStream:
    """A request's events from its decode worker. Before the first token a dead worker is
    replaced (the request is resubmitted elsewhere); after it, the request ends with an error."""

    def __init__(
        self, request_id: str, response: httpx.Response, member: Member,
        resubmit: Callable[[], Any], down: Callable[[Member, BaseException], None], stats: RouterStats,
        finish: Callable[[TokenEvent], Awaitable[TokenEvent]] | None = None,
    ) -> None:
        """``finish``: what the final event goes through (the router adds its part of the timeline)."""
        self.request_id, self._response, self._member = request_id, response, member
        self._finish = finish
        self._resubmit, self._down, self._stats = resubmit, down, stats
        self.finished = False
        self._tokens = 0
        self._lines: AsyncIterator[str] | None = None
        self._closing: asyncio.Future[None] | None = None  # cancel's close, referenced until done

    def __aiter__(self) -> ClusterStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        while True:
            if self._lines is None:
                self._lines = self._response.aiter_lines()
            try:
                line = await anext(self._lines)
            except (httpx.TransportError, StopAsyncIteration) as exc:
                await self._response.aclose()
                self._down(self._member, exc if isinstance(exc, httpx.TransportError) else WorkerDown("stream ended"))
                if self._tokens == 0:  # nothing reached the client: run it elsewhere
                    self._stats.retries += 1
                    try:
                        self._response, self._member = await self._resubmit()
                    except Exception as err:
                        self.finished = True
                        return TokenEvent(self.request_id, None, "", finish_reason=FinishReason.ERROR,
                                          error=f"no decode worker could finish the request: {err}")
                    self._lines = None
                    continue
                self.finished = True
                return TokenEvent(self.request_id, None, "", finish_reason=FinishReason.ERROR,
                                  error=f"decode worker {self._member.url} failed after {self._tokens} tokens")
            if not line:
                continue
            ev = Event.model_validate_json(line).event(self.request_id)
            self._tokens += ev.token_id is not None
            if ev.finish_reason is not None:
                self.finished = True
                await self._response.aclose()
                if self._finish is not None:
                    ev = await self._finish(ev)
            return ev

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self._closing = asyncio.ensure_future(self._response.aclose())  # the worker sees the disconnect and frees the KV
