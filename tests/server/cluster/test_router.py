"""The router's fault handling against scripted workers (an in-process httpx transport): which
decode worker a request lands on when one dies before, or after, its first token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from agentshare.protocol import AgentInfo
from server.backend import AgentCard, EngineFacts
from server.cluster.auth import HEADER, ClusterSecret
from server.cluster.members import Member, facts_of
from server.cluster.messages import WorkerInfo, WorkerStats
from server.cluster.router import ClusterBackend, RouterConfig
from server.engine.errors import InvalidRequest, Unavailable
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason
from server.prompt import Prompt

PROMPT = Prompt((1, 2, 3, 4, 5), 0, 0, 5)  # no full block before the IP: nothing to offload
SECRET = ClusterSecret.generate()
CODER = AgentInfo(name="coder", kind="lora", family="fam", shares_prefill=True, placement="turn")


def info(url: str, role: str = "decode", family: str = "fam", agents: tuple[AgentInfo, ...] = (CODER,)) -> WorkerInfo:
    return WorkerInfo(role=role, url=url, family=family, agents=list(agents), block_size=16, max_context=4096,
                      kv_dtype="float32", kv_bytes_per_token=3072, threads=1, pid=1)


def lines(*events: dict) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in events)


TOKEN = {"token_id": 7, "text": "x"}
END = {"token_id": 8, "text": "y", "finish_reason": "length", "usage": [5, 0, 2]}


class Broken(httpx.AsyncByteStream):
    """A response body that sends ``head`` and then loses the connection."""

    def __init__(self, head: bytes = b"") -> None:
        self.head = head

    async def __aiter__(self):
        if self.head:
            yield self.head
        raise httpx.ReadError("connection reset by peer")


def backend(handler: Callable[[httpx.Request], httpx.Response]) -> ClusterBackend:
    members = [Member(0, "http://d1", info("http://d1"), alive=True), Member(1, "http://d2", info("http://d2"), alive=True)]
    facts = EngineFacts("fam", {"coder": AgentCard("coder", "lora", "fam", True)}, None, 16, 4096)
    return ClusterBackend(facts, members, RouterConfig(health_interval=3600), secret=SECRET,
                          transport=httpx.MockTransport(handler))


async def run(b: ClusterBackend) -> tuple[list, list[str]]:
    await b.start()
    try:
        stream = await b.submit("r1", "coder", PROMPT, SamplingParams(max_tokens=2))
        events = [ev async for ev in stream]
        return events, [m.url for m in b.members if m.alive]
    finally:
        await b.stop()


def test_a_decode_worker_that_refuses_connections_is_skipped():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "d1":
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, content=lines(TOKEN, END))

    b = backend(handler)
    events, alive = asyncio.run(run(b))
    assert [e.token_id for e in events] == [7, 8] and events[-1].finish_reason is FinishReason.LENGTH
    assert alive == ["http://d2"] and b.stats.retries == 1


def test_a_decode_worker_that_dies_before_its_first_token_is_replaced():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "d1":
            return httpx.Response(200, stream=Broken())
        return httpx.Response(200, content=lines(TOKEN, END))

    b = backend(handler)
    events, alive = asyncio.run(run(b))
    assert [e.token_id for e in events] == [7, 8]
    assert alive == ["http://d2"]


def test_a_decode_worker_that_dies_after_a_token_ends_the_request_with_an_error():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Broken(lines(TOKEN)))

    events, _ = asyncio.run(run(backend(handler)))
    assert [e.token_id for e in events] == [7, None]
    assert events[-1].finish_reason is FinishReason.ERROR and "after 1 tokens" in (events[-1].error or "")


def test_no_live_decode_worker_for_the_agent_is_a_clear_503():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    with pytest.raises(Unavailable, match="no decode worker serving agent 'coder'"):
        asyncio.run(run(backend(handler)))


def test_an_engine_error_on_the_worker_is_raised_as_the_same_type():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json={"kind": "InvalidRequest", "message": "top_p must be in (0, 1]"})

    with pytest.raises(InvalidRequest, match="top_p"):
        asyncio.run(run(backend(handler)))


def test_workers_of_another_family_cannot_form_a_cluster():
    with pytest.raises(InvalidRequest, match="different families"):
        facts_of([info("http://d1"), info("http://p1", role="prefill", family="other")], tokenizer=None)
    with pytest.raises(InvalidRequest, match="at least one decode worker"):
        facts_of([info("http://p1", role="prefill", agents=())], tokenizer=None)


def test_an_agents_measured_fidelity_reaches_the_routers_listing():
    from agentshare.protocol import Fidelity

    measured = Fidelity(metric="exact", points=1.0, shared=0.9, own=0.92, gap_points=2.0, ci_points=[0.5, 3.5],
                        recompute_layers=8, layers=30, rows={"train": 300, "held_out": 100})
    coder = CODER.model_copy(update={"fidelity": measured})
    wire = WorkerInfo.model_validate_json(info("http://d1", agents=(coder,)).model_dump_json())  # as it travels
    facts = facts_of([wire, info("http://p1", role="prefill")], tokenizer=None)
    assert facts.agents["coder"].info().fidelity == measured


def test_a_joining_worker_of_another_family_is_refused():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/info":
            return httpx.Response(200, json=info("http://x", family="other").model_dump())
        return httpx.Response(200, json=WorkerStats(role="decode").model_dump())

    async def join() -> None:
        b = backend(handler)
        await b.start()
        try:
            await b.join("http://x")
        finally:
            await b.stop()

    with pytest.raises(InvalidRequest, match="serves family"):
        asyncio.run(join())


def test_a_links_bandwidth_is_measured_by_its_own_time_not_the_prefills():
    """A prefill order takes 10 s (mostly compute) and moves 1 MB in 0.1 s: the link is 10 MB/s,
    not 0.1 MB/s (that mistake made every later offload look slower than a local prefill)."""
    from server.cluster.messages import Prefill, Prefilled

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=Prefilled(transfer_id="t", blocks=4, bytes=1_000_000, seconds=10.0,
                                                  link_seconds=0.1, computed_tokens=64, cached_tokens=0).model_dump())

    b = backend(handler)
    source, dest = b.members
    order = Prefill(transfer_id="t", token_ids=list(range(64)), first_block=0, destination="shm://x:1", codec="bf16")

    async def go() -> None:
        await b.start()
        try:
            await b._run_transfer(source, dest, order, 64, 1_000_000)
        finally:
            await b.stop()

    asyncio.run(go())
    assert source.link_bytes_s == pytest.approx(1e7)
    assert source.queued_tokens == 0 and source.queued_bytes == 0


def test_a_worker_joins_by_url_and_then_takes_requests():
    """A decode worker on another host announces itself; the router reads its facts and routes
    to it (here: the only decode worker left alive)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/info":
            return httpx.Response(200, json=info(f"http://{request.url.host}").model_dump())
        if request.url.host == "x" and request.url.path == "/internal/stats":
            return httpx.Response(200, json=WorkerStats(role="decode").model_dump())
        if request.url.host == "x" and request.url.path == "/internal/generate":
            return httpx.Response(200, content=lines(TOKEN, END))
        raise httpx.ConnectError("connection refused")

    async def go() -> tuple[list, list[str]]:
        b = backend(handler)
        await b.start()
        try:
            joined = await b.join("http://x")
            assert joined.url == "http://x" and await b.join("http://x") == joined  # idempotent
            stream = await b.submit("r1", "coder", PROMPT, SamplingParams(max_tokens=2))
            return [ev async for ev in stream], [m.url for m in b.members if m.alive]
        finally:
            await b.stop()

    events, alive = asyncio.run(go())
    assert [e.token_id for e in events] == [7, 8]
    assert alive == ["http://x"]


def test_every_call_to_a_worker_carries_the_cluster_token():
    """Workers refuse internal calls without it: the router sends it on each one (info, stats,
    generate), and never the secret itself."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/internal/info":
            return httpx.Response(200, json=info(f"http://{request.url.host}").model_dump())
        if request.url.path == "/internal/stats":
            return httpx.Response(200, json=WorkerStats(role="decode").model_dump())
        return httpx.Response(200, content=lines(TOKEN, END))

    async def go() -> None:
        b = backend(handler)
        await b.start()
        try:
            await b.join("http://x")
            stream = await b.submit("r1", "coder", PROMPT, SamplingParams(max_tokens=2))
            assert [ev.token_id async for ev in stream] == [7, 8]
        finally:
            await b.stop()

    asyncio.run(go())
    assert {r.url.path for r in seen} >= {"/internal/info", "/internal/generate"}
    assert all(r.headers.get(HEADER) == SECRET.http_token() for r in seen)
    assert not any(SECRET._value.decode() in str(r.headers) for r in seen)


@pytest.mark.parametrize(("agent", "prefill_keeps", "codec", "moved", "hidden"), [
    ("coder", [], "fp32", True, []),  # no split anywhere on the way: the blocks alone
    ("coder", [22], "fp32", True, [22]),  # the decode worker keeps layer 22's input for its split agent: it goes too
    ("coder", [22], "bf16", True, []),  # lossy for fp32 KV: those blocks fill nobody
    ("splitter", [], "fp32", False, None),  # the prefill worker cannot send it: a split agent's prefix stays put
    ("splitter", [22], "bf16", False, None),
    ("splitter", [22], "fp32", True, [22]),
])
def test_a_layer_split_agents_prefix_moves_only_with_its_hidden_state(agent, prefill_keeps, codec, moved, hidden):
    """Blocks fill a split agent only with the base's hidden state at its split: the router
    moves a split agent's prefix only from a prefill worker that keeps that state, and asks it
    to send it; a plain agent's prefix moves either way, with the state where the source has it."""
    splitter = AgentInfo(name="splitter", kind="lora", family="fam", shares_prefill=True, placement="turn",
                         recompute_layers=8)
    calls: list[str] = []
    bodies: dict[str, dict] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        calls.append(f"{request.url.host}{path}")
        body = json.loads(request.content) if request.content else {}
        bodies[path] = body
        if path == "/internal/lookup":
            return httpx.Response(200, json={"cached_tokens": 0})
        if path == "/internal/kv/expect":
            return httpx.Response(200, json={"transfer_id": body["transfer_id"], "first_block": 0,
                                             "num_blocks": len(body["token_ids"]) // 16,
                                             "address": {"tcp": "tcp://d:1", "shm": "shm://d:1"}})
        if path == "/internal/prefill":
            return httpx.Response(200, json={"transfer_id": body["transfer_id"], "blocks": 32, "bytes": 1,
                                             "seconds": 0.1, "link_seconds": 0.1, "computed_tokens": 512,
                                             "cached_tokens": 0})
        if path == "/internal/generate":
            return httpx.Response(200, content=lines(TOKEN, END))
        return httpx.Response(404)

    p_info = info("http://p", role="prefill", agents=()).model_copy(update={"hidden_depths": prefill_keeps})
    d_info = info("http://d", agents=(CODER, splitter)).model_copy(update={"hidden_depths": [22]})
    members = [Member(0, "http://p", p_info, alive=True), Member(1, "http://d", d_info, alive=True)]
    cards = {"coder": AgentCard("coder", "lora", "fam", True),
             "splitter": AgentCard("splitter", "lora", "fam", True, recompute_layers=8)}
    b = ClusterBackend(EngineFacts("fam", cards, None, 16, 4096), members,
                       RouterConfig(health_interval=3600, codec=codec), secret=SECRET,
                       transport=httpx.MockTransport(handler))
    prompt = Prompt(tuple(range(1, 601)), 512, 512, 600)  # 512 tokens of context: 32 full blocks

    async def go() -> list:
        await b.start()
        try:
            events = [ev async for ev in await b.submit("r1", agent, prompt, SamplingParams(max_tokens=2))]
            await asyncio.gather(*b._transfers)  # the transfer's order runs in the background
            return events
        finally:
            await b.stop()

    events = asyncio.run(go())
    assert events[-1].finish_reason is FinishReason.LENGTH and "d/internal/generate" in calls
    assert ("d/internal/kv/expect" in calls) == moved, calls  # the transfer starts with it
    if moved:
        assert bodies["/internal/kv/expect"]["hidden"] == bool(hidden)
        assert bodies["/internal/prefill"]["hidden_depths"] == hidden
    else:
        assert "p/internal/prefill" not in calls
