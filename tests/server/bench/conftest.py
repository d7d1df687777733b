"""Fixtures of the load-benchmark tests: a corpus on the real tokenizer, and a scripted fake
OpenAI endpoint whose timings are known."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from server.bench.text import Corpus

TTFT_S, ITL_S, TOKENS = 0.30, 0.10, 4
"""The fake's ``steady`` model: its first token after TTFT_S, then one every ITL_S, TOKENS in all."""
PROMPT_TOKENS, CACHED_TOKENS = 200, 50


@pytest.fixture(scope="session")
def corpus(smollm2_tokenizer: Any) -> Corpus:
    return Corpus(smollm2_tokenizer, tokens=20_000)


def _chunk(content: str | None = None, usage: dict[str, Any] | None = None) -> str:
    body: dict[str, Any] = {"object": "chat.completion.chunk",
                            "choices": [] if content is None else [{"index": 0, "delta": {"content": content}}]}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


async def _chat(request: Request) -> Response:
    body = await request.json()
    model = body["model"]
    if model == "busy":
        return JSONResponse({"error": {"message": "queue full", "type": "rate_limit"}}, status_code=429)
    if model == "slow":
        await asyncio.sleep(5)

    async def events() -> AsyncIterator[str]:
        await asyncio.sleep(TTFT_S)
        for i in range(TOKENS):
            if i:
                await asyncio.sleep(ITL_S)
            if model == "broken" and i == 2:
                yield f"data: {json.dumps({'error': {'message': 'engine stopped'}})}\n\n"
                return
            yield _chunk(f"t{i} ")
        yield _chunk(usage={"prompt_tokens": PROMPT_TOKENS, "completion_tokens": TOKENS,
                            "total_tokens": PROMPT_TOKENS + TOKENS,
                            "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS}})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": m, "object": "model"}
                                                    for m in ("steady", "busy", "slow", "broken")]})


async def _metrics(request: Request) -> Response:
    return PlainTextResponse("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 1.0\n")


@pytest.fixture(scope="session")
def fake_url() -> Iterator[str]:
    """A scripted OpenAI endpoint on 127.0.0.1: models ``steady`` (TTFT_S, ITL_S, TOKENS),
    ``busy`` (429), ``slow`` (answers after 5 s), ``broken`` (an error event after 2 tokens)."""
    import uvicorn

    app = Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"]),
                            Route("/v1/models", _models), Route("/metrics", _metrics)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, name="fake-openai", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the fake endpoint did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
