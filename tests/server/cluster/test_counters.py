"""The token counters, exactly, on a fixed script of requests: engines in this process, as one
colocated engine and as a prefill engine with two decode engines (the router's moves made by
hand with :mod:`server.cluster.handoff`, no network).

Every prompt token of a request is counted once, where the request is served::

    prompt = computed (by its engine) + reused (from that engine's pool) + imported (over a link)

and a prefill engine's work for another engine's request is counted apart (``exported_*``),
never as prompt tokens. Expected figures come from the prompts' lengths and the block size:
``P`` is the shared prefix, the full blocks before the agents' turn (what any module of the
family reads)."""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from pathlib import Path

import pytest

from server import positions
from server.cluster.handoff import Inbound, Outbound
from server.engine.build import load_engine
from server.engine.config import EngineStats
from server.engine.core import EngineConfig, EngineCore
from server.engine.sampling import SamplingParams
from server.prompt import Placement, Prompt, chat_prompt

BS = 16
AGENTS = ("coder", "planner", "reviewer")
CONTEXT = [{"role": "user", "content": "Shared notes: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(30))}]
QUESTIONS = {"coder": "Write the code for item 4.", "planner": "Plan around item 9, briefly.",
             "reviewer": "Review items 1 to 3."}
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
_ids = itertools.count()


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path, make_lora) -> EngineCore:
    return load_engine(tiny_model_dir, modules={a: make_lora(a, i + 1) for i, a in enumerate(AGENTS)},
                       dtype="float32")


def engine(loaded: EngineCore) -> EngineCore:
    return loaded.with_config(EngineConfig(kv_cache_bytes=16 << 20, max_step_tokens=64, block_size=BS))


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> dict[str, Prompt]:
    out = {a: chat_prompt(smollm2_tokenizer, CONTEXT, [{"role": "user", "content": q}]) for a, q in QUESTIONS.items()}
    turn = {p.invocation_point(Placement.TURN) for p in out.values()}
    assert len(turn) == 1  # one context: every agent's turn starts at the same position
    for p in out.values():
        assert len(p.token_ids) % BS  # a trailing partial block: no prompt is found whole in a cache
    return out


def shared(prompt: Prompt) -> int:
    """P: the full blocks before the turn (the family's, for every agent)."""
    return prompt.invocation_point(Placement.TURN) // BS * BS


def drain(core: EngineCore) -> None:
    for _ in range(10_000):
        if not core.has_work:
            return
        core.step()
    raise AssertionError("the engine did not finish")


def figures(s: EngineStats) -> dict[str, int]:
    """The counters by role and source (what /metrics shows as agentshare_prefix_tokens_total)."""
    return {"prompt": s.prompt_tokens, "computed": s.prefill_tokens - s.exported_prefill_tokens,
            "reused": s.cached_prompt_tokens - s.imported_prompt_tokens, "imported": s.imported_prompt_tokens,
            "prefill_computed": s.exported_prefill_tokens, "prefill_reused": s.exported_cached_tokens}


def total(*cores: EngineCore) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for core in cores:
        for k, v in figures(core.stats).items():
            out[k] += v
    return dict(out)


def identity_holds(f: dict[str, int]) -> bool:
    return f["prompt"] == f["computed"] + f["reused"] + f["imported"]


def serve(dec: EngineCore, module: str, prompt: Prompt, *, salt: str = "", prefill: EngineCore | None = None) -> None:
    """One request on ``dec``; with ``prefill``, its shared prefix offloaded there first as the
    router does: ``dec`` expects the blocks it lacks, the request waits on them, they arrive."""
    rid = f"r{next(_ids)}"
    if prefill is None:
        dec.add_request(rid, module, prompt, GREEDY, salt=salt)
        drain(dec)
        return
    prefix = list(prompt.token_ids[: positions.shared_prefix_len(prompt, dec.modules[module], block_size=BS)])
    tid = f"{rid}/kv"
    inbound = Inbound.expect(dec, tid, prefix, salt=salt, prefix_codec=None, ttl=60)
    dec.add_request(rid, module, prompt, GREEDY, salt=salt)
    dec.step()  # admitted: it waits on the arriving blocks
    if inbound.num_blocks:
        loop = asyncio.new_event_loop()
        try:
            out = Outbound.start(prefill, tid, prefix, salt=salt, first_block=inbound.first_block, chunk_blocks=2,
                                 ttl=60, loop=loop)
            while not out.done:
                prefill.step()
                out.on_step(prefill)
            loop.run_until_complete(asyncio.sleep(0))
            while not out.queue.empty():
                if (chunk := out.queue.get_nowait()) is not None:
                    inbound.write(dec, chunk)
        finally:
            loop.close()
        prefill.release_context(tid)
    inbound.finish(dec)
    drain(dec)


# ---- colocated ---------------------------------------------------------------------------------


def test_colocated_three_agents_share_the_prefix_once(loaded, prompts):
    core = engine(loaded)
    n, p = {a: len(prompts[a].token_ids) for a in AGENTS}, shared(prompts["coder"])
    for a in AGENTS:
        before = figures(core.stats)
        serve(core, a, prompts[a])
        one = {k: v - before[k] for k, v in figures(core.stats).items()}
        assert identity_holds(one)  # per request
    assert figures(core.stats) == {"prompt": sum(n.values()), "computed": sum(n.values()) - 2 * p, "reused": 2 * p,
                                   "imported": 0, "prefill_computed": 0, "prefill_reused": 0}


def test_colocated_three_tenants_share_nothing(loaded, prompts):
    core = engine(loaded)
    prompt = prompts["coder"]
    n = len(prompt.token_ids)
    for tenant in ("a", "b", "c"):
        serve(core, "coder", prompt, salt=tenant)
    assert figures(core.stats) == {"prompt": 3 * n, "computed": 3 * n, "reused": 0, "imported": 0,
                                   "prefill_computed": 0, "prefill_reused": 0}
    serve(core, "coder", prompt, salt="a")  # tenant a again: its whole prompt's full blocks
    assert figures(core.stats)["reused"] == n // BS * BS and identity_holds(figures(core.stats))


def test_colocated_a_local_request_computes_its_prompt(loaded, prompts):
    core = engine(loaded)
    n = len(prompts["planner"].token_ids)
    serve(core, "planner", prompts["planner"])
    assert figures(core.stats) == {"prompt": n, "computed": n, "reused": 0, "imported": 0,
                                   "prefill_computed": 0, "prefill_reused": 0}


# ---- one prefill engine, two decode engines ----------------------------------------------------


def test_disaggregated_three_agents_count_each_prompt_token_once(loaded, prompts):
    prefill, d1, d2 = engine(loaded), engine(loaded), engine(loaded)
    n, p = {a: len(prompts[a].token_ids) for a in AGENTS}, shared(prompts["coder"])
    serve(d1, "coder", prompts["coder"], prefill=prefill)  # P computed by the prefill engine, imported
    serve(d2, "planner", prompts["planner"], prefill=prefill)  # P found there, imported by d2
    serve(d1, "reviewer", prompts["reviewer"], prefill=prefill)  # d1 holds P: nothing moves, reused
    assert figures(prefill.stats) == {"prompt": 0, "computed": 0, "reused": 0, "imported": 0,
                                      "prefill_computed": p, "prefill_reused": p}
    assert figures(d1.stats) == {"prompt": n["coder"] + n["reviewer"], "computed": n["coder"] + n["reviewer"] - 2 * p,
                                 "reused": p, "imported": p, "prefill_computed": 0, "prefill_reused": 0}
    cluster = total(prefill, d1, d2)
    assert cluster == {"prompt": sum(n.values()), "computed": sum(n.values()) - 3 * p, "reused": p, "imported": 2 * p,
                       "prefill_computed": p, "prefill_reused": p}
    assert identity_holds(cluster)
    # the old double count: the prefill engine's cache hits are no longer prompt tokens read from cache
    assert sum(c.stats.cached_prompt_tokens for c in (prefill, d1, d2)) == 3 * p <= cluster["prompt"]


def test_disaggregated_three_tenants_move_the_prefix_three_times(loaded, prompts):
    prefill, d1, d2 = engine(loaded), engine(loaded), engine(loaded)
    prompt = prompts["coder"]
    n, p = len(prompt.token_ids), shared(prompt)
    for tenant, dec in (("a", d1), ("b", d2), ("c", d1)):
        serve(dec, "coder", prompt, salt=tenant, prefill=prefill)
    cluster = total(prefill, d1, d2)
    assert cluster == {"prompt": 3 * n, "computed": 3 * (n - p), "reused": 0, "imported": 3 * p,
                       "prefill_computed": 3 * p, "prefill_reused": 0}
    assert identity_holds(cluster)


def test_disaggregated_a_request_kept_local_recomputes_what_the_prefill_engine_holds(loaded, prompts):
    """The router keeps the planner's prefill on d2 (say, the link is saturated) although the
    prefill engine holds its prefix: d2 computes it again, counted as computed by the decode role."""
    prefill, d1, d2 = engine(loaded), engine(loaded), engine(loaded)
    nc, np_, p = len(prompts["coder"].token_ids), len(prompts["planner"].token_ids), shared(prompts["coder"])
    serve(d1, "coder", prompts["coder"], prefill=prefill)
    serve(d2, "planner", prompts["planner"])  # kept local
    assert figures(d2.stats)["computed"] == np_
    cluster = total(prefill, d1, d2)
    assert cluster == {"prompt": nc + np_, "computed": nc - p + np_, "reused": 0, "imported": p,
                       "prefill_computed": p, "prefill_reused": 0}
    assert identity_holds(cluster)


def test_a_failed_transfer_is_recomputed_and_counted_once(loaded, prompts):
    """One chunk (2 blocks) arrives, then the sender dies: the request re-plans and computes the
    rest; the 2 blocks stay imported, the rest is computed, never both."""
    prefill, dec = engine(loaded), engine(loaded)
    prompt = prompts["coder"]
    n = len(prompt.token_ids)
    prefix = list(prompt.token_ids[: shared(prompt)])
    loop = asyncio.new_event_loop()
    try:
        out = Outbound.start(prefill, "t", prefix, salt="", first_block=0, chunk_blocks=2, ttl=60, loop=loop)
        while not out.done:
            prefill.step()
            out.on_step(prefill)
        loop.run_until_complete(asyncio.sleep(0))
        first = out.queue.get_nowait()
    finally:
        loop.close()
    inbound = Inbound.expect(dec, "t", prefix, salt="", prefix_codec=None, ttl=60)
    dec.add_request("r", "coder", prompt, GREEDY)
    dec.step()
    inbound.write(dec, first)
    inbound.fail(dec)
    drain(dec)
    assert dec.stats.replans == 1
    assert figures(dec.stats) == {"prompt": n, "computed": n - 2 * BS, "reused": 0, "imported": 2 * BS,
                                  "prefill_computed": 0, "prefill_reused": 0}
