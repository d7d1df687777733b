import asyncio

import pytest

from server.engine.async_engine import AsyncEngine, EngineClosed
from server.engine.build import load_engine
from server.engine.core import EngineConfig
from server.engine.errors import UnknownModule
from server.engine.sampling import SamplingParams
from server.prompt import chat_prompt

CONTEXT = [{"role": "user", "content": "Shared: " + "the quick brown fox. " * 30}]


@pytest.fixture
def async_engine(tiny_model_dir):
    core = load_engine(tiny_model_dir, dtype="float32", config=EngineConfig(kv_cache_bytes=16 << 20))
    engine = AsyncEngine(core)
    yield engine
    engine.close()


def prompt(tok, text="Go."):
    return chat_prompt(tok, CONTEXT, [{"role": "user", "content": text}])


async def collect(engine, rid, p, params):
    return [e async for e in engine.generate(rid, "base", p, params)]


def test_concurrent_requests_stream_to_their_own_callers(async_engine, smollm2_tokenizer):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(async_engine, f"r{i}", prompt(smollm2_tokenizer), params) for i in range(3)))

    results = asyncio.run(main())
    tokens = [[e.token_id for e in r if e.token_id is not None] for r in results]
    assert all(len(t) == 6 for t in tokens) and tokens[0] == tokens[1] == tokens[2]
    assert all(r[-1].finish_reason is not None and r[-1].usage.completion_tokens == 6 for r in results)
    # One prefill for the three (in-flight dedup, or a cache hit if one arrived late): whichever
    # request ran first computed the whole prompt; each other one was served every full block of
    # it but the last position's (sampled from a computed row), and computed only that remainder.
    n, bs = len(prompt(smollm2_tokenizer).token_ids), async_engine.core.config.block_size
    served = bs * ((n - 1) // bs)
    assert served > 0
    assert sorted(r[-1].usage.cached_tokens for r in results) == [0, served, served]
    stats = asyncio.run(async_engine.run(lambda core: (core.stats.prefill_tokens, core.stats.cached_prompt_tokens)))
    assert stats == (n + 2 * (n - served), 2 * served)


def test_a_bad_request_raises_in_the_caller_and_the_engine_keeps_serving(async_engine, smollm2_tokenizer):
    async def main():
        with pytest.raises(UnknownModule):
            async for _ in async_engine.generate("bad", "nope", prompt(smollm2_tokenizer), SamplingParams()):
                pass
        return await collect(async_engine, "ok", prompt(smollm2_tokenizer), SamplingParams(max_tokens=3))

    assert asyncio.run(main())[-1].finish_reason is not None


def test_leaving_the_stream_early_cancels_and_frees_kv(async_engine, smollm2_tokenizer):
    async def main():
        stream = async_engine.generate("r", "base", prompt(smollm2_tokenizer),
                                       SamplingParams(max_tokens=200, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            usage = await async_engine.run(lambda core: (core.has_work, core.pool.usage().held))
            if usage == (False, 0):
                return usage
            await asyncio.sleep(0.02)
        return usage

    assert asyncio.run(main()) == (False, 0)


def test_closed_engine_refuses_new_work(async_engine, smollm2_tokenizer):
    async_engine.close()

    async def main():
        async for _ in async_engine.generate("r", "base", prompt(smollm2_tokenizer), SamplingParams()):
            pass

    with pytest.raises(EngineClosed):
        asyncio.run(main())


def test_load_builds_the_core_on_the_engine_thread_and_serves_it_there(tiny_model_dir, smollm2_tokenizer):
    """Loading and stepping share one native thread (one OpenMP team: AsyncEngine.load says
    why); a build that fails raises in the caller."""
    import threading

    threads = {}

    def build():
        threads["build"] = threading.current_thread().name
        return load_engine(tiny_model_dir, dtype="float32", config=EngineConfig(kv_cache_bytes=16 << 20))

    engine = AsyncEngine.load(build)
    try:
        assert threads["build"] == "agentshare-engine" != threading.current_thread().name
        assert asyncio.run(async_engine_step_thread(engine)) == "agentshare-engine"
        events = asyncio.run(collect(engine, "r", prompt(smollm2_tokenizer),
                                     SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
        assert events[-1].usage.completion_tokens == 3
    finally:
        engine.close()

    def broken():
        raise FileNotFoundError("no model here")

    with pytest.raises(FileNotFoundError, match="no model here"):
        AsyncEngine.load(broken)


async def async_engine_step_thread(engine):
    import threading

    return await engine.run(lambda core: threading.current_thread().name)
