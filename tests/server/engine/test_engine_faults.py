"""One bad request fails alone; a stuck step is stopped by the watchdog; the engine keeps serving.

On the old engine the first test's request raised out of ``EngineCore.step`` (an exception in
the sampler), which killed the engine thread: every later request waited forever.
"""

import asyncio
import threading
import time

import pytest

from server.engine import output as output_module
from server.engine.async_engine import AsyncEngine
from server.engine.build import load_engine
from server.engine.core import EngineConfig, EngineCore
from server.engine.errors import Unavailable
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason
from server.prompt import chat_prompt

GOOD = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ISSUE_14 = SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def base_core(tiny_model_dir) -> EngineCore:
    return load_engine(tiny_model_dir, dtype="float32", config=EngineConfig(kv_cache_bytes=16 << 20))


@pytest.fixture
def core(base_core) -> EngineCore:
    return base_core.with_config(EngineConfig(kv_cache_bytes=16 << 20))


def prompt(tok, text="hello there, how are you?"):
    return chat_prompt(tok, [], [{"role": "user", "content": text}])


def run_all(core: EngineCore, max_steps: int = 200) -> dict[str, list]:
    events: dict[str, list] = {}
    for _ in range(max_steps):
        if not core.has_work:
            return events
        for ev in core.step():
            events.setdefault(ev.request_id, []).append(ev)
    raise AssertionError("the engine did not finish its requests")


def tokens(events) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def test_the_issue_14_top_p_request_is_served_beside_another(core, smollm2_tokenizer):
    p = prompt(smollm2_tokenizer)
    core.add_request("top_p", "base", p, ISSUE_14)
    core.add_request("good", "base", p, GOOD)
    out = run_all(core)
    assert out["top_p"][-1].finish_reason is FinishReason.LENGTH and len(tokens(out["top_p"])) == 4
    assert tokens(out["top_p"]) == tokens(out["good"])  # a nucleus of one token is greedy
    assert core.pool.usage().held == 0


@pytest.mark.parametrize("where", ["sampler", "logits_hook", "forward", "admission"])
def test_a_request_that_raises_in_the_step_fails_alone(where, core, smollm2_tokenizer, monkeypatch):
    p, other = prompt(smollm2_tokenizer), prompt(smollm2_tokenizer, "Something else entirely.")
    core.add_request("alone", "base", other, GOOD)
    want = tokens(run_all(core)["alone"])
    # drawn, not greedy: a plain greedy row's token is picked beside the logits, not by the sampler
    marker = SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True, seed=4242)

    def boom() -> None:
        raise RuntimeError(f"injected in the {where}")

    if where == "sampler":
        real = output_module.sample

        def sample(logits, params, *args, **kw):
            if any(q.seed == 4242 for q in params):
                boom()
            return real(logits, params, *args, **kw)

        monkeypatch.setattr(output_module, "sample", sample)
    elif where == "logits_hook":
        core.logits_hook = lambda rid, row: boom() if rid == "bad" else None
    elif where == "forward":
        real_run = core.runner.run
        monkeypatch.setattr(core.runner, "run", lambda work, *a: boom() if any(s.request_id == "bad" for s, _, _ in work)
                            else real_run(work, *a))
    else:
        real_reserve = core.scheduler.reserve
        monkeypatch.setattr(core.scheduler, "reserve", lambda seq: boom() if seq.request_id == "bad" else real_reserve(seq))
    core.add_request("bad", "base", p, marker)
    core.add_request("good", "base", other, GOOD)
    out = run_all(core)
    end = out["bad"][-1]
    assert end.finish_reason is FinishReason.ERROR and end.error == f"RuntimeError: injected in the {where}"
    assert out["good"][-1].finish_reason is FinishReason.LENGTH and tokens(out["good"]) == want
    assert core.pool.usage().held == 0  # the failed request's KV is back
    core.logits_hook = None
    monkeypatch.undo()
    core.add_request("after", "base", p, GOOD)
    assert run_all(core)["after"][-1].finish_reason is FinishReason.LENGTH


async def collect(engine: AsyncEngine, rid: str, p, params=GOOD) -> list:
    return [e async for e in engine.generate(rid, "base", p, params)]


def test_a_step_that_raises_as_a_whole_fails_its_requests_and_the_engine_serves_on(core, smollm2_tokenizer):
    engine = AsyncEngine(core)
    real_step, calls = core.step, []

    def step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: the step broke")
        return real_step()

    core.step = step  # type: ignore[method-assign]
    try:
        first = asyncio.run(collect(engine, "first", prompt(smollm2_tokenizer)))
        assert first[-1].finish_reason is FinishReason.ERROR and "injected: the step broke" in first[-1].error
        again = asyncio.run(collect(engine, "again", prompt(smollm2_tokenizer)))
        assert again[-1].finish_reason is FinishReason.LENGTH
        assert engine.health().degraded is None
        assert asyncio.run(engine.run(lambda c: c.pool.usage().held)) == 0
    finally:
        engine.close()


@pytest.mark.timeout(120)  # the stall and the recovery are waited for in real time
def test_the_watchdog_fails_a_stuck_step_reports_it_and_the_engine_recovers(core, smollm2_tokenizer):
    release = threading.Event()
    core.logits_hook = lambda rid, row: release.wait(30) if rid == "stuck" else None
    engine = AsyncEngine(core, step_timeout=0.5)
    p = prompt(smollm2_tokenizer)

    async def main():
        started = time.monotonic()
        stuck = asyncio.create_task(collect(engine, "stuck", p))
        await asyncio.sleep(0.2)
        queued = asyncio.create_task(engine.submit("queued", "base", p, GOOD))  # waits behind the stuck step
        end = (await asyncio.wait_for(stuck, 10))[-1]
        took = time.monotonic() - started
        assert end.finish_reason is FinishReason.ERROR and "0.5 s limit (step_timeout)" in end.error
        with pytest.raises(Unavailable, match="step_timeout"):
            await asyncio.wait_for(queued, 5)
        health = engine.health()
        assert health.degraded is not None and "0.5 s limit" in health.degraded and health.stalls == 1
        with pytest.raises(Unavailable, match="retry later"):
            await engine.submit("meanwhile", "base", p, GOOD)
        release.set()
        deadline = time.monotonic() + 10
        while engine.health().degraded is not None:
            assert time.monotonic() < deadline, "the engine did not recover"
            await asyncio.sleep(0.05)
        after = await collect(engine, "after", p)
        held = await engine.run(lambda c: (len(c.waiting), len(c.running), c.pool.usage().held))
        return took, after, held

    try:
        took, after, held = asyncio.run(main())
    finally:
        release.set()
        engine.close()
    assert took < 5  # 0.5 s limit, checked every 0.125 s
    assert after[-1].finish_reason is FinishReason.LENGTH
    assert held == (0, 0, 0)  # the stuck request was cancelled in the core, its KV freed


def test_a_caller_that_gives_up_while_its_request_is_queued_does_not_stop_the_engine(core, smollm2_tokenizer):
    """The engine thread once completed the caller's cancelled future, which raised and killed it."""
    release = threading.Event()
    core.logits_hook = lambda rid, row: release.wait(30) if rid == "busy" else None
    engine = AsyncEngine(core)
    p = prompt(smollm2_tokenizer)

    async def main():
        busy = asyncio.create_task(collect(engine, "busy", p))
        await asyncio.sleep(0.2)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.submit("gone", "base", p, GOOD), 0.2)
        release.set()
        await busy
        after = await collect(engine, "after", p)
        held = await engine.run(lambda c: ([s.request_id for s in [*c.waiting, *c.running]], c.pool.usage().held))
        return after, held

    try:
        after, held = asyncio.run(main())
    finally:
        release.set()
        engine.close()
    assert after[-1].finish_reason is FinishReason.LENGTH
    assert held == ([], 0)  # "gone" was cancelled as soon as the engine saw it


def test_a_dead_engine_thread_is_reported_and_refuses_work(core, smollm2_tokenizer):
    engine = AsyncEngine(core)

    def die() -> None:
        raise RuntimeError("injected: the loop broke")

    engine._settle = die  # type: ignore[method-assign]  # the loop's own bookkeeping, outside every guard
    try:
        end = asyncio.run(collect(engine, "r", prompt(smollm2_tokenizer)))[-1]
        assert end.finish_reason is FinishReason.ERROR and "the engine thread died" in end.error
        engine._thread.join(5)
        assert "the engine thread died (RuntimeError: injected: the loop broke)" == engine.health().degraded
        with pytest.raises(Unavailable):
            asyncio.run(engine.submit("later", "base", prompt(smollm2_tokenizer), GOOD))
    finally:
        engine.close()
