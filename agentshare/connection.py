"""The HTTP connection of one :class:`~agentshare.client.AsyncClient`, shared by its contexts.

The client owns it, and the local server it may launch; each
:class:`~agentshare.context.SharedContext` the client makes holds the same connection (not the
client), so a context needs nothing else of its client::

    AsyncClient ──▶ Connection ◀── SharedContext
                      ├─ request(method, path, body)   JSON in, JSON (or text) out, errors typed
                      ├─ stream(path, body)            the data: events of a server-sent-event response
                      └─ server                        a LocalServer: started on first use, stopped by aclose()

Semi-internal: applications use the client and its contexts; this is their common plumbing.

>>> content_body("What changed?")
{'messages': [{'role': 'user', 'content': 'What changed?'}]}
>>> content_body("Appendix A.", text_kind=True)
{'text': 'Appendix A.'}
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import httpx

from agentshare import protocol
from agentshare.errors import AgentshareError, ConnectionFailed, error_from_response
from agentshare.local_server import LocalServer

_STREAM_ERROR_STATUS = {"authentication_error": 401, "rate_limit_error": 429, "invalid_request_error": 400,
                        "service_unavailable": 503}


class Connection:
    """One server's HTTP connection: opened on first use (launching ``server`` if given), closed
    by :meth:`aclose` (which stops that server)."""

    def __init__(self, base_url: str | None, *, api_key: str | None, timeout: float,
                 transport: httpx.AsyncBaseTransport | None, server: LocalServer | None) -> None:
        self.api_key, self.timeout, self.server = api_key, timeout, server
        self._base_url = base_url.rstrip("/") if base_url else None
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._lock: anyio.Lock | None = None
        self.closed = False

    @property
    def base_url(self) -> str | None:
        """The server's URL (a launched server's once started)."""
        return self._base_url or (self.server.url if self.server is not None else None)

    async def open(self) -> httpx.AsyncClient:
        """The open ``httpx`` client; the first call launches the server (if any) and connects."""
        if self.closed:
            raise ConnectionFailed("this client is closed")
        if self._http is not None:
            return self._http
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if self._http is None:
                if self.server is not None and not self.server.running:
                    try:
                        await self.server.start()
                    except BaseException:
                        self.server.kill()
                        raise
                headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                self._http = httpx.AsyncClient(
                    base_url=self.base_url or "http://agentshare", headers=headers, transport=self._transport,
                    timeout=httpx.Timeout(self.timeout, connect=10.0))
        return self._http

    async def aclose(self) -> None:
        """Close the connection and stop a launched server (waits until its process is gone)."""
        self.closed = True
        with anyio.CancelScope(shield=True):
            if self._http is not None:
                await self._http.aclose()
                self._http = None
            if self.server is not None:
                await self.server.stop()

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One call: its JSON (or text) body; an error status raises its :class:`AgentshareError`."""
        http = await self.open()
        try:
            resp = await http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise ConnectionFailed(f"{method} {self.base_url}{path}: {exc!r}") from exc
        if resp.status_code >= 400:
            raise response_error(resp.status_code, resp.content, resp.headers.get("retry-after"))
        return resp.json() if resp.headers.get("content-type", "").startswith("application/json") else resp.text

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The ``data:`` events of a server-sent-event response, until ``[DONE]``."""
        http = await self.open()
        try:
            async with http.stream("POST", path, json=body) as resp:
                if resp.status_code >= 400:
                    raise response_error(resp.status_code, await resp.aread(), resp.headers.get("retry-after"))
                async for line in resp.aiter_lines():
                    event = sse_event(line)
                    if event is DONE:
                        return
                    if event is not None:
                        yield event
        except httpx.TransportError as exc:
            raise ConnectionFailed(f"POST {self.base_url}{path}: {exc!r}") from exc
        # a clean close before [DONE]: the answer is cut short, never a complete one
        raise ConnectionFailed(f"POST {self.base_url}{path}: the stream ended before [DONE] (connection closed "
                               "mid-response, e.g. by a proxy or a server restart); retry the request")


DONE: Any = object()
"""What :func:`sse_event` returns for the stream's last line, ``data: [DONE]``."""


def sse_event(line: str) -> dict[str, Any] | None:
    """One line of a server-sent-event stream: its ``data:`` JSON, :data:`DONE` at the end, or
    ``None`` (not a data line); an error event raises its :class:`AgentshareError`.

    >>> sse_event('data: {"id": "c1"}'), sse_event(": keep-alive"), sse_event("data: [DONE]") is DONE
    ({'id': 'c1'}, None, True)
    """
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE  # type: ignore[no-any-return]
    event: dict[str, Any] = json.loads(data)
    if "error" in event:  # an error after the stream started
        etype = str((event["error"] or {}).get("type", ""))
        raise error_from_response(_STREAM_ERROR_STATUS.get(etype, 500), event)
    return event


def content_body(content: str | Sequence[Any], *, text_kind: bool = False) -> dict[str, Any]:
    """The body of a context's content: chat messages (a string is one user message), or text."""
    if isinstance(content, str):
        return {"text": content} if text_kind else {"messages": [{"role": "user", "content": content}]}
    if text_kind:
        raise ValueError("a text context is extended with text, not messages")
    return {"messages": [_message(m) for m in content]}


def _message(m: Any) -> dict[str, Any]:
    return m.model_dump(exclude_none=True) if isinstance(m, protocol.ChatMessage) else dict(m)


def response_error(status: int, content: bytes, retry_after: str | None) -> AgentshareError:
    """The :class:`AgentshareError` of an error response (its status, body and Retry-After)."""
    try:
        body: Any = json.loads(content)
    except ValueError:
        body = content.decode(errors="replace")
    return error_from_response(status, body, retry_after=retry_after)
