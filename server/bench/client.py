"""One streamed chat request, timed token by token, as ``vllm bench serve`` times it.

TTFT runs from sending the request to the first chunk that carries text; ITL is the gap between
consecutive text chunks; E2E runs to the end of the stream. Usage comes from the final chunk
(``stream_options.include_usage``), the cached prompt tokens from
``usage.prompt_tokens_details.cached_tokens`` where the server reports them (vLLM does with
``--enable-prompt-tokens-details``). A request that fails (an HTTP error status, an error event, a
broken connection, a timeout, a stream without a token) is kept, with what went wrong: none is
dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    """One request's life; times are ``time.perf_counter()`` seconds."""

    session: int
    agent: str
    step: int
    sent: float
    max_tokens: int = 0
    """The tokens asked for (with ``ignore_eos``)."""
    first: float | None = None
    done: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    """None: the server did not say (vLLM without ``--enable-prompt-tokens-details``)."""
    text: str = ""
    status: int | None = None
    """The HTTP status (None: no response)."""
    error: str | None = None
    failure: str | None = None
    """``http_429``, ``http_5xx``, ``http_4xx``, ``timeout``, ``connection``, ``stream`` or None."""
    warmup: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        assert self.first is not None, "a request without a token has no TTFT"
        return self.first - self.sent

    @property
    def e2e(self) -> float:
        assert self.done is not None, "an unfinished request has no E2E"
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for a single-token answer."""
        if self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def fail(self, failure: str, error: str) -> RequestResult:
        self.failure, self.error = failure, error
        return self


def _failure_of(status: int) -> str:
    return "http_429" if status == 429 else "http_5xx" if status >= 500 else "http_4xx"


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult, *,
                      headers: dict[str, str] | None = None, timeout: float = 600.0) -> RequestResult:
    """Send ``body`` (streamed, with usage) to ``url``/v1/chat/completions and fill ``result``.

    Never raises for what the server does: the failure is recorded in ``result``.
    """
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    stamps: list[float] = []
    parts: list[str] = []
    result.sent = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
                result.status = resp.status_code
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    return result.fail(_failure_of(resp.status_code), f"HTTP {resp.status_code}: {text[:300]}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.fail("stream", json.dumps(chunk["error"])[:300])
                        break
                    if usage := chunk.get("usage"):
                        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        result.completion_tokens = int(usage.get("completion_tokens") or 0)
                        details = usage.get("prompt_tokens_details")
                        if details and details.get("cached_tokens") is not None:
                            result.cached_tokens = int(details["cached_tokens"])
                    for choice in chunk.get("choices") or []:
                        if content := (choice.get("delta") or {}).get("content"):
                            stamps.append(time.perf_counter())
                            parts.append(content)
    except TimeoutError:
        result.fail("timeout", f"no complete answer within {timeout:g} s")
    except httpx.HTTPError as exc:
        result.fail("connection", f"{type(exc).__name__}: {exc}")
    except json.JSONDecodeError as exc:
        result.fail("stream", f"a chunk that is not JSON: {exc}")
    result.text = "".join(parts)
    if stamps:
        result.first = stamps[0]
        result.itl = [b - a for a, b in itertools.pairwise(stamps)]
    if result.ok:
        result.done = time.perf_counter()
        if not stamps:
            result.fail("stream", "the stream ended without a token")
        elif result.completion_tokens == 0:
            result.completion_tokens = len(stamps)  # a server without usage in the stream: one token per chunk
    return result
