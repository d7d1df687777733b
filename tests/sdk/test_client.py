"""The SDK against a real server (tiny model, fp32, two LoRA agents) reached by URL, under
asyncio and trio: generate, stream, fork, extend, explain, metrics, error mapping."""

from __future__ import annotations

import pytest

from agentshare import (
    Agent,
    AsyncClient,
    BadRequestError,
    ConnectionFailed,
    NotFoundError,
    Sampling,
)
from agentshare.local_server import free_port

pytestmark = pytest.mark.anyio

# ~400 tokens of shared context: long next to each agent's turn
DOC = " ".join(f"Record {i}: the service in zone {i % 7} keeps {i % 5 + 1} replicas and fails over to zone "
               f"{(i + 3) % 7}." for i in range(24))
GREEDY = {"max_tokens": 6, "temperature": 0}


@pytest.fixture
def doc(request: pytest.FixtureRequest) -> str:
    """A context no other test (or backend) uses, so none is served another's cached blocks."""
    return f"[{request.node.name}] {DOC}"


async def test_generate_reports_cached_and_computed_tokens(server_url: str, doc: str) -> None:
    async with AsyncClient(server_url) as client:
        ctx = await client.context(doc)
        # all computed but the chat template's default system prompt (a block every chat shares)
        assert ctx.tokens > 300 and ctx.cached_tokens <= 32 and ctx.computed_tokens == ctx.tokens - ctx.cached_tokens
        a = await ctx.generate("base", "How many replicas in zone 2?", **GREEDY)
        assert a.agent == a.module == "base" and a.finish_reason == "length"
        assert a.usage.completion_tokens == len(a.token_ids) == 6 and a.text
        assert a.usage.cached_tokens >= ctx.pinned_tokens  # the context was not prefilled again
        assert a.usage.computed_tokens == a.usage.prompt_tokens - a.usage.cached_tokens
        assert a.timings.ttft is not None and 0 < a.timings.ttft <= a.timings.total
        again = await ctx.generate("base", "How many replicas in zone 2?", **GREEDY)
        assert again.text == a.text  # greedy, same prompt
        await ctx.release()
        assert ctx.released and not await ctx.release()


async def test_stream_equals_generate(server_url: str, doc: str) -> None:
    async with AsyncClient(server_url) as client, await client.context(doc) as ctx:
        whole = await ctx.generate("coder", "Write a haiku.", **GREEDY)
        chunks = [c async for c in ctx.stream("coder", "Write a haiku.", **GREEDY)]
        assert "".join(c.text for c in chunks) == whole.text
        assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage is not None
        assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])


async def test_fork_of_three_agents_prefills_the_shared_part_once(server_url: str, doc: str) -> None:
    async with AsyncClient(server_url) as client:
        before = await client.metrics()
        async with await client.context(doc) as ctx:
            team = await ctx.fork([
                Agent("retriever", instruction="Quote the record of zone 3."),
                Agent("planner", module="planner", instruction="Plan a failover drill."),
                (Agent("coder", module="coder", sampling=Sampling(max_tokens=4)), "Write a health check."),
            ], temperature=0, max_tokens=5)
        spent = await client.metrics() - before
    assert [a.agent for a in team] == ["retriever", "planner", "coder"]
    assert [a.module for a in team] == ["base", "planner", "coder"]
    assert team["coder"].usage.completion_tokens == 5  # the call's sampling overrides the agent's
    for a in team:
        assert a.usage.cached_tokens >= ctx.pinned_tokens > 0
        assert a.usage.computed_tokens < ctx.tokens // 4  # only its own turn (and the partial last block)
    # the server's counters: one prefill of the context, then only each agent's turn
    assert ctx.computed_tokens >= ctx.tokens - 48  # its one prefill (the template's system block was cached)
    assert spent.prefill_computed_tokens == ctx.computed_tokens + team.computed_tokens
    assert spent.prefill_cached_tokens >= 3 * ctx.pinned_tokens
    assert spent.cross_module_hit_blocks > 0  # LoRA agents read blocks the base computed
    assert "3 agents on one shared context" in team.table()
    html = team._repr_html_()
    assert "<table>" in html and "planner" in html and "cached" in html


async def test_extend_prefills_only_the_new_part(server_url: str, doc: str) -> None:
    async with AsyncClient(server_url) as client, await client.context(doc) as ctx:
        before = ctx.tokens
        same = await ctx.extend([{"role": "assistant", "content": "Noted."},
                                 {"role": "user", "content": "Observation: zone 4 is down."}])
        assert same is ctx and ctx.tokens > before
        assert ctx.computed_tokens < ctx.tokens - before + 16  # new tokens (and one partial block)
        a = await ctx.generate("planner", "What now?", **GREEDY)
        assert a.usage.cached_tokens >= ctx.pinned_tokens


async def test_text_context_and_explain(server_url: str, doc: str) -> None:
    async with AsyncClient(server_url) as client, await client.context(text=doc) as ctx:
        assert ctx.kind == "text"
        e = await client.explain("coder", context=ctx, prompt="\nAnswer:")
        assert e.shares_prefill and e.cached_tokens >= ctx.pinned_tokens
        a = await ctx.generate("base", "\nAnswer:", **GREEDY)
        assert a.usage.cached_tokens >= ctx.pinned_tokens
        cold = await client.explain("base", [{"role": "user", "content": "an unseen context " * 30},
                                             {"role": "user", "content": "q"}])
        assert cold.cached_tokens <= 32 and cold.first_miss_block is not None and cold.first_miss_block <= 2
        assert {s.name for s in await client.agents()} == {"base", "coder", "planner"}


async def test_errors_map_to_the_exception_tree(server_url: str, doc: str) -> None:
    async with AsyncClient(server_url) as client, await client.context(doc) as ctx:
        with pytest.raises(NotFoundError, match="nobody"):
            await ctx.generate("nobody", "hi")
        with pytest.raises(NotFoundError):  # the same error out of a fork, not an exception group
            await ctx.fork([("base", "a"), ("nobody", "b")], max_tokens=2)
        with pytest.raises(BadRequestError) as err:
            await ctx.generate("base", "hi", temperature=5.0)
        assert err.value.status == 422
        with pytest.raises(TypeError, match="unknown sampling"):
            await ctx.generate("base", "hi", temprature=0)
    async with AsyncClient(server_url) as client:
        with pytest.raises(NotFoundError):
            await client._request("GET", "/v1/contexts/ctx_missing")
    async with AsyncClient(f"http://127.0.0.1:{free_port()}") as nobody:
        with pytest.raises(ConnectionFailed):
            await nobody.agents()


async def test_closed_client_refuses_and_context_release_is_quiet(server_url: str, doc: str) -> None:
    client = AsyncClient(server_url)
    ctx = await client.context(doc)
    await client.aclose()
    assert not await ctx.release()
    with pytest.raises(ConnectionFailed, match="closed"):
        await client.agents()
