"""Every SDK exception class, raised the way users meet it.

From the real server (tiny model, fp32, two LoRA agents, API keys, a 2 MiB KV pool), where the
server produces the status: 401, 404, 413, 422, 429 with Retry-After. What only a proxy or a
crash produces (5xx, a non-JSON body, a connection dropped mid-stream, an error event in the
middle of a stream) through ``httpx.MockTransport`` in the client's transport. The
``Authorization`` header is checked on the wire.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentshare import (
    AgentshareError,
    APIError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    ConnectionFailed,
    InternalServerError,
    NotFoundError,
    RateLimitError,
)
from server.api.config import ServerConfig
from server.engine.build import load_engine
from server.engine.core import EngineConfig
from tests.server.helpers import running_server

pytestmark = pytest.mark.anyio

KEY, OTHER_KEY = "sdk-errors-key", "sdk-errors-other-key"
POOL = 2 << 20  # ~42 blocks of 16 tokens on the tiny model
PIN_TTL = 120.0


@pytest.fixture(scope="module")
def keyed_url(tiny_model_dir: Path, lora_dirs: dict[str, Path]) -> Iterator[str]:
    """The real server with two API keys (two tenants) and a small KV pool (so 413 and 429 are reachable)."""
    core = load_engine(tiny_model_dir, modules=lora_dirs, dtype="float32", config=EngineConfig(kv_cache_bytes=POOL))
    with running_server(core, ServerConfig(api_keys=(KEY, OTHER_KEY), kv_cache_bytes=POOL, default_max_tokens=8)) as url:
        yield url


@pytest.fixture
def doc(request: pytest.FixtureRequest) -> str:
    """A text no other test (or backend) uses."""
    return f"[{request.node.name}] the service keeps two replicas per zone and fails over to the next zone."


def kv_capacity_blocks(url: str) -> int:
    text = httpx.get(url + "/metrics").text
    return int(float(re.search(r"^agentshare_kv_blocks_capacity (\S+)$", text, re.MULTILINE)[1]))  # type: ignore[index]


# ---- from the real server ----------------------------------------------------------------------


async def test_401_without_a_key_or_with_a_wrong_one(keyed_url: str) -> None:
    async with AsyncClient(keyed_url) as nokey:
        with pytest.raises(AuthenticationError) as err:
            await nokey.agents()
    assert (err.value.status, err.value.type, err.value.code) == (401, "authentication_error", "invalid_api_key")
    assert "requires an API key" in err.value.message
    async with AsyncClient(keyed_url, api_key="not-" + KEY) as wrong:
        with pytest.raises(AuthenticationError, match="invalid API key") as err:
            await wrong.context("a document")
    assert err.value.status == 401 and err.value.retry_after is None
    async with AsyncClient(keyed_url, api_key=KEY) as right:  # the header the SDK sends is the one the server reads
        assert {a.name for a in await right.agents()} == {"base", "coder", "planner"}


async def test_404_unknown_context_and_unknown_agent(keyed_url: str, doc: str) -> None:
    async with AsyncClient(keyed_url, api_key=KEY) as client:
        with pytest.raises(NotFoundError) as err:
            await client.attach("ctx_missing")
        assert err.value.status == 404 and err.value.code == "not_found"
        async with await client.context(text=doc) as ctx:
            with pytest.raises(NotFoundError, match="nobody") as err:  # the streaming path
                await ctx.generate("nobody", "hi")
            assert (err.value.code, err.value.param) == ("model_not_found", "agent")
            with pytest.raises(NotFoundError) as err:  # out of a fork: the error itself, not a group
                await ctx.fork([("base", "a"), ("nobody", "b")], max_tokens=2)
            assert err.value.code == "model_not_found"


async def test_422_a_value_out_of_range_names_its_param(keyed_url: str, doc: str) -> None:
    async with AsyncClient(keyed_url, api_key=KEY) as client, await client.context(text=doc) as ctx:
        with pytest.raises(BadRequestError) as err:
            await ctx.generate("base", "hi", temperature=5.0)
        assert (err.value.status, err.value.type, err.value.param) == (422, "invalid_request_error", "temperature")
        with pytest.raises(BadRequestError) as err:
            await client.context(text=doc, ttl=-1)
        assert (err.value.status, err.value.param) == (422, "ttl")


async def test_413_a_request_larger_than_the_context_or_the_kv_pool(keyed_url: str, doc: str) -> None:
    async with AsyncClient(keyed_url, api_key=KEY) as client:
        with pytest.raises(BadRequestError) as err:  # longer than the model's context (4,096)
            await client.context(text="word " * 5000)
        assert (err.value.status, err.value.code) == (413, "context_length_exceeded")
        async with await client.context(text=doc) as ctx:
            tokens = 16 * kv_capacity_blocks(keyed_url) + 16  # fits the model, not the whole pool
            with pytest.raises(BadRequestError, match="KV pool") as err:
                await ctx.generate("base", "hi", max_tokens=tokens)
            # the field that holds the turn of a text context
            assert (err.value.status, err.value.code, err.value.param) == (413, "context_length_exceeded", "text")


async def test_429_carries_retry_after_from_the_pins_ttl(keyed_url: str, doc: str, smollm2_tokenizer: Any) -> None:
    """Two tenants' pinned contexts fill the pool: the server refuses with Retry-After = the time
    until the first pin ends, and the SDK's ``retry_after`` is that figure, on both request paths
    (a JSON response and a stream refused before its first byte)."""
    capacity = kv_capacity_blocks(keyed_url)
    half = capacity // 2  # the most one tenant may pin
    async with AsyncClient(keyed_url, api_key=KEY) as a, AsyncClient(keyed_url, api_key=OTHER_KEY) as b:
        async with await a.context(text=doc, ttl=PIN_TTL) as small, \
                await a.context(text=words(smollm2_tokenizer, f"a {doc}", 16 * (half - 3)), ttl=PIN_TTL) as big, \
                await b.context(text=words(smollm2_tokenizer, f"b {doc}", 16 * half - 8), ttl=PIN_TTL) as theirs:
            pinned = [c.pinned_tokens // 16 for c in (small, big, theirs)]
            room = capacity - sum(pinned)  # tenants share no blocks
            assert 0 <= room <= 4 and pinned[0] >= 1, (capacity, pinned)
            more = words(smollm2_tokenizer, f"another {doc}", 16 * (room + 2))
            with pytest.raises(RateLimitError) as err:  # a context that needs more than the room left
                await a.context(text=more, ttl=PIN_TTL)
            assert (err.value.status, err.value.type) == (429, "rate_limit_error")
            assert err.value.retry_after is not None and PIN_TTL - 10 <= err.value.retry_after <= PIN_TTL
            # streamed: a generation after the small context needing more than the room (far less than the pool)
            want = 16 * (room + 4)
            with pytest.raises(RateLimitError, match="pinned") as err:
                await small.generate("base", "Go.", max_tokens=want)
            assert (err.value.status, err.value.code) == (429, "overloaded")
            assert err.value.retry_after is not None and PIN_TTL - 10 <= err.value.retry_after <= PIN_TTL
        # released: the context that was refused is admitted
        async with await a.context(text=more, ttl=PIN_TTL) as admitted:
            assert admitted.pinned_tokens >= 16 * (room + 1)


def words(tokenizer: Any, prefix: str, n: int) -> str:
    """``prefix`` and filler words: ``n`` tokens in all (as a text context tokenizes it)."""
    text = prefix
    while len(tokenizer.encode(text, add_special_tokens=False)) < n:
        text += " word"
    assert len(tokenizer.encode(text, add_special_tokens=False)) == n
    return text


# ---- what only a proxy or a crash produces (httpx.MockTransport) -------------------------------

CONTEXT_INFO = {"id": "ctx_mock", "object": "context", "kind": "text", "tokens": 40, "cached_tokens": 0,
                "computed_tokens": 40, "pinned_tokens": 32, "ttl": 600.0, "expires_at": 2e9}


def chunk(text: str, token: int, *, last: bool = False) -> bytes:
    event: dict[str, object] = {"id": "gen_mock", "object": "generation.chunk", "agent": "base",
                                "context_id": "ctx_mock", "text": text, "token_ids": [token]}
    if last:
        event |= {"finish_reason": "length", "usage": {"prompt_tokens": 41, "cached_tokens": 32,
                                                       "computed_tokens": 9, "completion_tokens": 2}}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


class Body(httpx.AsyncByteStream):
    """An SSE body that sends ``parts`` and then, if given, fails as a dropped connection does."""

    def __init__(self, parts: list[bytes], fail: Exception | None = None) -> None:
        self.parts, self.fail = parts, fail

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part
        if self.fail is not None:
            raise self.fail


def mock_client(generate: Callable[[httpx.Request], httpx.Response], *,
                api_key: str | None = None) -> tuple[AsyncClient, list[httpx.Request]]:
    """A client whose transport answers context creation, and ``generate`` for the stream."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/contexts":
            return httpx.Response(201, json=CONTEXT_INFO)
        if request.method == "DELETE":
            return httpx.Response(200, json={"id": "ctx_mock", "object": "context.released", "released": True})
        return generate(request)

    return AsyncClient(transport=httpx.MockTransport(handler), api_key=api_key), seen


def sse(parts: list[bytes], fail: Exception | None = None) -> Callable[[httpx.Request], httpx.Response]:
    return lambda _: httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Body(parts, fail))


async def test_the_api_key_is_sent_as_a_bearer_header_on_every_request() -> None:
    client, seen = mock_client(lambda _: httpx.Response(404, json={"error": {"message": "no", "type": "x"}}),
                               api_key="k-123")
    async with client:
        await client.context(text="doc")
        with pytest.raises(NotFoundError):
            await client.health()
    assert [r.headers.get("authorization") for r in seen] == ["Bearer k-123", "Bearer k-123"]
    anonymous, seen = mock_client(lambda _: httpx.Response(200, json={}))
    async with anonymous:
        await anonymous.context(text="doc")
    assert "authorization" not in seen[0].headers


@pytest.mark.parametrize("status", [500, 502, 503, 504])
async def test_5xx_is_an_internal_server_error(status: int) -> None:
    body = {"error": {"message": "engine error: boom", "type": "server_error", "param": None, "code": "engine_error"}}
    client, _ = mock_client(lambda _: httpx.Response(status, json=body, headers={"Retry-After": "7"}))
    async with client, await client.context(text="doc") as ctx:
        with pytest.raises(InternalServerError) as err:
            await ctx.generate("base", "hi")
    assert (err.value.status, err.value.type, err.value.code, err.value.message) == (
        status, "server_error", "engine_error", "engine error: boom")
    assert err.value.retry_after == 7.0


async def test_a_non_json_error_body_keeps_its_text() -> None:
    html = "<html><body><h1>502 Bad Gateway</h1></body></html>"
    client, _ = mock_client(lambda _: httpx.Response(502, text=html, headers={"content-type": "text/html"}))
    async with client, await client.context(text="doc") as ctx:
        with pytest.raises(InternalServerError) as err:
            await ctx.generate("base", "hi")
    assert (err.value.status, err.value.message, err.value.type, err.value.code) == (502, html, "", None)
    assert str(err.value) == f"502: {html}"


@pytest.mark.parametrize("status, cls", [(400, BadRequestError), (401, AuthenticationError), (403, AuthenticationError),
                                         (404, NotFoundError), (409, BadRequestError), (413, BadRequestError),
                                         (422, BadRequestError), (429, RateLimitError), (500, InternalServerError)])
async def test_each_status_maps_to_its_class_with_a_plain_text_body(status: int, cls: type[APIError]) -> None:
    client, _ = mock_client(lambda _: httpx.Response(status, text="refused by the gateway"))
    async with client:
        with pytest.raises(cls) as err:
            await client.health()
    assert type(err.value) is cls and err.value.status == status and err.value.message == "refused by the gateway"


async def test_retry_after_as_an_http_date() -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    for header, low, high in ((when, 25.0, 30.0), ("12", 12.0, 12.0), ("soon", None, None), ("-3", None, None)):
        client, _ = mock_client(lambda _, h=header: httpx.Response(429, text="slow down", headers={"Retry-After": h}))
        async with client:
            with pytest.raises(RateLimitError) as err:
                await client.health()
        if low is None:
            assert err.value.retry_after is None, header
        else:
            assert err.value.retry_after is not None and low <= err.value.retry_after <= high, header


@pytest.mark.parametrize("etype, status, cls", [("server_error", 500, InternalServerError),
                                                ("service_unavailable", 503, InternalServerError),
                                                ("rate_limit_error", 429, RateLimitError),
                                                ("invalid_request_error", 400, BadRequestError)])
async def test_an_error_event_in_the_middle_of_a_stream_raises_after_the_chunks_before_it(
    etype: str, status: int, cls: type[APIError]
) -> None:
    error = b'data: {"error": {"message": "generation failed: boom", "type": "%s", "code": "x"}}\n\n' % etype.encode()
    client, _ = mock_client(sse([chunk("Hel", 1), chunk("lo", 2), error, chunk("!", 3, last=True), b"data: [DONE]\n\n"]))
    async with client, await client.context(text="doc") as ctx:
        got: list[str] = []
        with pytest.raises(cls) as err:
            async for c in ctx.stream("base", "hi"):
                got.append(c.text)
        assert got == ["Hel", "lo"]  # nothing after the error event is taken as the answer
        assert (err.value.status, err.value.message, err.value.code) == (status, "generation failed: boom", "x")
        with pytest.raises(cls):
            await ctx.generate("base", "hi")


@pytest.mark.parametrize("fail", [httpx.RemoteProtocolError("peer closed connection without sending complete message"),
                                  httpx.ReadError("connection reset by peer"), None])
async def test_a_connection_dropped_mid_stream_is_connection_failed(fail: Exception | None) -> None:
    """A reset, a truncated chunked body, or a clean close before ``[DONE]``: never a short answer."""
    client, _ = mock_client(sse([chunk("Hel", 1), chunk("lo", 2)], fail))
    async with client, await client.context(text="doc") as ctx:
        got: list[str] = []
        with pytest.raises(ConnectionFailed, match="ctx_mock/generate") as err:
            async for c in ctx.stream("base", "hi"):
                got.append(c.text)
        assert got == ["Hel", "lo"]
        assert isinstance(err.value, AgentshareError)
        with pytest.raises(ConnectionFailed):
            await ctx.generate("base", "hi")


async def test_a_complete_stream_through_the_same_transport_is_an_answer() -> None:
    """The control of the two tests above: the mock stream itself is well formed."""
    client, seen = mock_client(sse([chunk("Hel", 1), chunk("lo", 2, last=True), b"data: [DONE]\n\n"]))
    async with client, await client.context(text="doc") as ctx:
        answer = await ctx.generate("base", "hi", max_tokens=2)
    assert (answer.text, answer.token_ids, answer.finish_reason) == ("Hello", (1, 2), "length")
    assert answer.usage.cached_tokens == 32
    body = json.loads(seen[1].content)
    assert seen[1].url.path == "/v1/contexts/ctx_mock/generate" and body["stream"] is True and body["max_tokens"] == 2
