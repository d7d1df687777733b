"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``.

>>> sse({"a": 1})
b'data: {"a":1}\\n\\n'
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.responses import StreamingResponse

from server.api.errors import ApiError

DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


def sse(payload: BaseModel | dict[str, Any]) -> bytes:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload, separators=(",", ":"))
    return b"data: " + body.encode() + b"\n\n"


def sse_error(err: ApiError) -> bytes:
    """An error after the stream started: OpenAI clients raise it from the chunk."""
    return sse(err.body())


def event_stream(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    """A streaming response; Starlette cancels ``chunks`` when the client disconnects."""
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def prime(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """Fetch the first item now (so errors raise before the response starts); return an
    iterator over all items that closes ``items`` when it is closed."""
    try:
        first: list[T] = [await anext(items)]
    except StopAsyncIteration:
        first = []

    async def rest() -> AsyncIterator[T]:
        try:
            for x in first:
                yield x
            async for x in items:
                yield x
        finally:
            await items.aclose()  # type: ignore[attr-defined]

    return rest()
