"""The engine core against the oracle of docs/design.md §2, on tiny random models with the real
SmolLM2 tokenizer and chat template, in fp32."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from server.engine.build import load_engine
from server.engine.core import EngineConfig, EngineCore
from server.engine.errors import InvalidRequest, PromptTooLong, UnknownModule
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason
from server.prompt import Placement, Prompt, chat_prompt

CONTEXT = [{"role": "user", "content": "Shared notes: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(40))}]
FORCED = (1500, 2000, 300, 4242, 77, 9000)
ATOL = 2e-4


def turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


_LOADED: dict[tuple, EngineCore] = {}


def engine(tiny_model_dir, modules=None, **cfg) -> tuple[EngineCore, dict]:
    """A fresh engine (empty pool); the model and modules are loaded once per session."""
    key = (tiny_model_dir, tuple(sorted((modules or {}).items())))
    if key not in _LOADED:
        # a tiny pool here: every test takes a fresh one with with_config, and the loaded engines
        # stay cached for the session (the default 1 GiB each would add up)
        _LOADED[key] = load_engine(tiny_model_dir, modules=modules, dtype="float32",
                                   config=EngineConfig(kv_cache_bytes=1 << 20))
    core = _LOADED[key].with_config(EngineConfig(**{"kv_cache_bytes": 32 << 20, **cfg}))
    logits: dict[str, list[torch.Tensor]] = defaultdict(list)
    core.logits_hook = lambda rid, row: logits[rid].append(row.clone())
    return core, logits


def drain(core: EngineCore) -> dict[str, list]:
    events = defaultdict(list)
    while core.has_work:
        for e in core.step():
            events[e.request_id].append(e)
    return events


def tokens_of(events) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def forced(n: int = len(FORCED)) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, forced_tokens=FORCED[:n], ignore_eos=True)


@pytest.mark.parametrize("kind", ["base", "lora", "full"])
@pytest.mark.parametrize("placement", [Placement.TURN, Placement.HEADER])
def test_a_request_served_from_another_modules_prefill_equals_the_oracle(
    tiny_model_dir, smollm2_tokenizer, make_lora, make_full, oracle, kind, placement
):
    module_dir = {"base": None, "lora": make_lora("m", placement=placement),
                  "full": make_full("m", placement=placement)}[kind]
    other = make_lora("other", seed=9)
    modules = {"other": other} | ({"m": module_dir} if module_dir else {})
    core, logits = engine(tiny_model_dir, modules)
    name = "m" if module_dir else "base"
    # first, another module computes (and caches) the shared context
    core.add_request("first", "other", chat_prompt(smollm2_tokenizer, CONTEXT, turn("Plan it.")), forced(2))
    drain(core)
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    seq = core.add_request("second", name, prompt, forced())
    events = drain(core)["second"]
    assert seq.cached_tokens >= 16 * (prompt.context_len // 16) > 0  # it really shared
    assert tokens_of(events) == list(FORCED)
    ip = len(prompt.token_ids) - 1 if kind == "base" else prompt.invocation_point(placement)
    tokens = list(prompt.token_ids) + list(FORCED[:-1])
    want = oracle(module_dir, kind, tokens, ip, len(FORCED))
    got = torch.stack(logits["second"])
    assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()




@pytest.mark.parametrize("placement", [Placement.TURN, Placement.HEADER])
def test_the_invocation_point_off_by_one(tiny_model_dir, smollm2_tokenizer, make_lora, placement):
    """The token just before the IP is computed by the base; the token at the IP by the module."""
    lora = make_lora("ip", placement=placement)
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    ip = prompt.invocation_point(placement)
    snapshots = {}
    for name in ("base", "ip"):
        core, logits = engine(tiny_model_dir, {"ip": lora})
        seq = core.add_request(name, name, prompt, forced(1))
        core.step()  # admission + the whole prompt (fits one step) + first token
        snapshots[name] = (torch.stack([core.kv.k[0][:, int(s)] for s in seq.slot_table[: ip + 1]]).clone(),
                           logits[name][0])
        drain(core)
    (kv_base, first_base), (kv_mod, first_mod) = snapshots["base"], snapshots["ip"]
    # layer 0 keys: positions < IP bitwise equal (base weights); position IP differs (module's)
    assert torch.equal(kv_base[:ip], kv_mod[:ip])
    assert not torch.allclose(kv_base[ip], kv_mod[ip])
    assert not torch.allclose(first_base, first_mod)


def test_three_modules_on_one_long_prompt_run_the_shared_part_through_the_base_once(
    tiny_model_dir, smollm2_tokenizer, make_lora, make_full
):
    long_context = [{"role": "user", "content": " ".join(f"fact {i}: value {i * 31 % 97}." for i in range(170))}]
    prompts = {n: chat_prompt(smollm2_tokenizer, long_context, turn(f"Agent {n}, answer.")) for n in "abc"}
    context_len = prompts["a"].context_len
    assert context_len >= 1000
    modules = {"a": make_lora("a", seed=3), "b": make_lora("b", seed=4), "c": make_full("c")}
    counts = {}
    for share in (True, False):
        core, _ = engine(tiny_model_dir, modules, share_prefill=share, max_step_tokens=256)
        base_rows = []
        real_forward = core.forward

        class Counting:  # counts every row that goes through the base weights' forward
            def __init__(self, real_forward, base_rows):
                self.real_forward, self.base_rows = real_forward, base_rows

            def __getattr__(self, name):
                return getattr(self.real_forward, name)

            def __call__(self, plan, kv, projection=None):
                self.base_rows.append(plan.num_tokens)
                return self.real_forward(plan, kv, projection=projection)

        core.forward = Counting(real_forward, base_rows)
        for n in "abc":
            core.add_request(n, n, prompts[n], SamplingParams(temperature=0, max_tokens=2))
        drain(core)
        counts[share] = (sum(base_rows), core.stats)
    shared_part = 16 * (context_len // 16)
    (rows_on, stats_on), (rows_off, stats_off) = counts[True], counts[False]
    total_prompt = sum(len(p.token_ids) for p in prompts.values())
    assert stats_on.cached_prompt_tokens == 2 * shared_part
    assert stats_off.cached_prompt_tokens == 0
    # with sharing the base computes the shared part once; without, three times
    assert stats_off.prefill_tokens - stats_on.prefill_tokens == 2 * shared_part
    assert rows_off - rows_on == 2 * shared_part
    assert stats_on.prefill_tokens == total_prompt - 2 * shared_part


def test_a_foreign_module_never_reads_the_familys_blocks_and_answers_correctly(
    tiny_model_dir, smollm2_tokenizer, make_full, oracle
):
    foreign = make_full("alien", foreign=True)
    core, logits = engine(tiny_model_dir, {"alien": foreign})
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    core.add_request("warm", "base", prompt, forced(1))
    drain(core)
    seq = core.add_request("alien", "alien", prompt, forced())
    assert not core.modules["alien"].shares_prefill
    drain(core)
    assert seq.cached_tokens == 0
    want = oracle(foreign, "full", list(prompt.token_ids) + list(FORCED[:-1]), 0, len(FORCED))
    assert torch.allclose(torch.stack(logits["alien"]), want, atol=ATOL)
    # and the family's blocks were not polluted either: the base still hits its own cache
    again = core.add_request("again", "base", prompt, forced(1))
    drain(core)
    assert again.cached_tokens == 16 * ((len(prompt.token_ids) - 1) // 16)  # every full block but the last row's


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_mixed_batch(
    tiny_model_dir, smollm2_tokenizer, make_lora
):
    modules = {"x": make_lora("x", seed=5), "y": make_lora("y", seed=6)}
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Say something."))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    core, _ = engine(tiny_model_dir, modules)
    core.add_request("alone", "x", prompt, params)
    alone = tokens_of(drain(core)["alone"])
    core, _ = engine(tiny_model_dir, modules)
    core.add_request("n1", "y", chat_prompt(smollm2_tokenizer, CONTEXT, turn("Other.")),
                     SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True))
    core.add_request("mixed", "x", prompt, params)
    core.add_request("n2", "base", prompt, SamplingParams(temperature=0.7, max_tokens=5))
    assert tokens_of(drain(core)["mixed"]) == alone
    assert len(set(alone)) > 3


def test_different_lora_modules_batched_together_equal_each_served_alone(
    tiny_model_dir, smollm2_tokenizer, make_lora
):
    modules = {"x": make_lora("x", seed=5), "y": make_lora("y", seed=6)}
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Answer briefly."))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = {}
    for name in ("x", "y", "base"):
        core, _ = engine(tiny_model_dir, modules)
        core.add_request(name, name, prompt, greedy)
        alone[name] = tokens_of(drain(core)[name])
    core, _ = engine(tiny_model_dir, modules)
    for name in ("x", "y", "base"):
        core.add_request(name, name, prompt, greedy)
    together = {k: tokens_of(v) for k, v in drain(core).items()}
    assert together == alone
    assert len({tuple(v) for v in alone.values()}) == 3  # the modules really differ


def test_stop_strings_stop_tokens_and_length(tiny_model_dir, smollm2_tokenizer):
    core, _ = engine(tiny_model_dir)
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Go."))
    core.add_request("free", "base", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    free = drain(core)["free"]
    assert free[-1].finish_reason is FinishReason.LENGTH and len(tokens_of(free)) == 10
    text = "".join(e.text for e in free)
    second = tokens_of(free)[1]
    core.add_request("tok", "base", prompt, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(second,)))
    tok = drain(core)["tok"]
    assert tokens_of(tok) == tokens_of(free)[:2] and tok[-1].finish_reason is FinishReason.STOP
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    core.add_request("str", "base", prompt, SamplingParams(temperature=0, max_tokens=10, stop=(stop,)))
    got = drain(core)["str"]
    assert got[-1].finish_reason is FinishReason.STOP
    assert "".join(e.text for e in got) == text[: text.index(stop)]


def test_cancellation_frees_every_block(tiny_model_dir, smollm2_tokenizer):
    core, _ = engine(tiny_model_dir, max_step_tokens=32)
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Go."))
    for i in range(3):
        core.add_request(f"r{i}", "base", prompt, SamplingParams(temperature=0, max_tokens=50))
    core.step()
    core.step()
    for i in range(3):
        assert core.cancel(f"r{i}").finish_reason is FinishReason.CANCELLED
    assert not core.has_work and core.pool.usage().held == 0
    assert core.cancel("r0") is None


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda tok: ("base", chat_prompt(tok, CONTEXT, turn("x" * 20000)), SamplingParams()), PromptTooLong),
        (lambda tok: ("nope", chat_prompt(tok, CONTEXT, turn("x")), SamplingParams()), UnknownModule),
        (lambda tok: ("base", chat_prompt(tok, [], []), SamplingParams()), InvalidRequest),
        (lambda tok: ("base", chat_prompt(tok, CONTEXT, turn("x")), SamplingParams(max_tokens=0)), InvalidRequest),
        (lambda tok: ("base", chat_prompt(tok, CONTEXT, turn("x")), SamplingParams(temperature=-1)), InvalidRequest),
        (lambda tok: ("base", chat_prompt(tok, CONTEXT, turn("x")), SamplingParams(top_p=1.5)), InvalidRequest),
    ],
)
def test_bad_input_is_a_typed_error_and_the_engine_keeps_serving(tiny_model_dir, smollm2_tokenizer, make, error):
    core, _ = engine(tiny_model_dir)
    with pytest.raises(error):
        core.add_request("bad", *make(smollm2_tokenizer))
    core.add_request("ok", "base", chat_prompt(smollm2_tokenizer, CONTEXT, turn("x")), SamplingParams(max_tokens=2))
    assert drain(core)["ok"][-1].finish_reason is not None


def test_a_pinned_context_is_prefilled_once_and_survives_pressure_until_released(
    tiny_model_dir, smollm2_tokenizer, make_lora
):
    core, _ = engine(tiny_model_dir, {"x": make_lora("x", seed=5)}, kv_cache_bytes=4 << 20)
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    ctx = prompt.token_ids[: prompt.context_len]
    core.add_context("ctx", ctx, ttl=60)
    done = drain(core)["ctx"]
    assert done[-1].finish_reason is FinishReason.PREFILLED and "ctx" in core.contexts
    shared = 16 * (len(ctx) // 16)
    # push more distinct prompts through the pool than it holds: LRU must evict, but not the pin
    for i in range(2 * core.pool.capacity * 16 // 600):
        filler = chat_prompt(smollm2_tokenizer, [{"role": "user", "content": f"{i} " + "z " * 580}], turn("q"))
        core.add_request(f"fill{i}", "base", filler, SamplingParams(max_tokens=1))
        drain(core)
    assert core.pool.stats.evictions > 0
    seq = core.add_request("agent", "x", prompt, SamplingParams(temperature=0, max_tokens=2))
    drain(core)
    assert seq.cached_tokens == shared
    assert core.release_context("ctx") and not core.release_context("ctx")
    with pytest.raises(InvalidRequest):
        core.add_context("bad", ctx, ttl=0)


def test_prefill_throughput_is_measured_on_prefill_steps_only():
    from server.engine.core import EngineStats

    s = EngineStats()
    s.observe_step(rows=8, prefill_rows=0, seconds=0.1)  # a decode step: no prefill figure
    assert s.prefill_tok_s == 0.0
    s.observe_step(rows=512, prefill_rows=500, seconds=0.5)
    assert s.prefill_tok_s == pytest.approx(1024.0)
    s.observe_step(rows=512, prefill_rows=512, seconds=1.0)
    assert s.prefill_tok_s == pytest.approx(0.7 * 1024 + 0.3 * 512)


def test_a_request_queued_behind_a_full_pool_reports_its_wait_in_its_timeline(tiny_model_dir, smollm2_tokenizer):
    first = chat_prompt(smollm2_tokenizer, CONTEXT, turn("First."))
    other = [{"role": "user", "content": "Other notes: " + " ".join(f"entry {i} reads {i * 5 % 11}." for i in range(40))}]
    second = chat_prompt(smollm2_tokenizer, other, turn("Second."))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    probe, _ = engine(tiny_model_dir)
    bs = probe.config.block_size
    need = [math.ceil((len(p.token_ids) + params.max_tokens) / bs) for p in (first, second)]
    core, _ = engine(tiny_model_dir, kv_cache_bytes=probe.kv.bytes_per_block * max(need))
    assert max(need) <= core.pool.capacity < sum(need)  # one fits, not both: the second waits
    core.add_request("a", "base", first, params)
    core.add_request("b", "base", second, params)
    events = drain(core)
    a, b = (events[r][-1].timeline for r in ("a", "b"))
    assert a is not None and b is not None
    assert a.queue_s < a.e2e_s < b.queue_s  # b was admitted only once a had freed its blocks
    for t, ev, prompt in ((a, events["a"][-1], first), (b, events["b"][-1], second)):
        assert ev.usage is not None and t.ttft_s is not None
        assert 0 <= t.queue_s <= t.ttft_s <= t.e2e_s
        assert t.decode_steps == ev.usage.completion_tokens - 1 == 3
        assert (t.computed_tokens, t.reused_tokens) == (len(prompt.token_ids) - ev.usage.cached_tokens,
                                                         ev.usage.cached_tokens)
        assert (t.route, t.prefill, t.imported_tokens, t.transfer_bytes) == ("colocated", "local", 0, 0)


def test_a_request_whose_cached_prefix_is_evictable_waits_for_room_rather_than_failing(tiny_model_dir, smollm2_tokenizer):
    # Found under load (benchmarks/under_load.py): admission counted the evictable blocks of the
    # request's own cached prefix as room for its fresh blocks; holding them took that room back,
    # and the request failed with PoolExhausted instead of waiting for memory.
    a = chat_prompt(smollm2_tokenizer, CONTEXT, turn("First."))
    b = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Second, and much longer: " + "say more. " * 12))
    other = [{"role": "user", "content": "Other notes: " + " ".join(f"entry {i} reads {i * 5 % 11}." for i in range(40))}]
    c = chat_prompt(smollm2_tokenizer, other, turn("Third."))
    short, long_b, long_c = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 24, 40))
    probe, _ = engine(tiny_model_dir)
    bs = probe.config.block_size

    def common(x: Prompt, y: Prompt) -> int:
        return next(i for i, (p, q) in enumerate(zip(x.token_ids, y.token_ids, strict=False)) if p != q)

    k = common(a, b) // bs  # the blocks b finds cached
    with_c = common(a, c) // bs  # of them, the template's head, which c holds too
    evictable = k - with_c  # a's own: evictable once a is done
    held_c = math.ceil((len(c.token_ids) + 40) / bs)
    fresh_b = math.ceil((len(b.token_ids) + 24) / bs) - k
    # b fits once c is done; beside c, only if its own evictable prefix counted as room twice
    capacity = held_c + evictable + fresh_b - 1
    core, _ = engine(tiny_model_dir, kv_cache_bytes=probe.kv.bytes_per_block * capacity)
    assert evictable >= 1 and core.pool.capacity == capacity
    assert math.ceil((len(a.token_ids) + 1) / bs) - with_c + held_c <= capacity  # a and c run together
    core.add_request("c", "base", c, long_c)
    core.add_request("a", "base", a, short)
    events: dict[str, list] = defaultdict(list)
    while not any(e.finish_reason for e in events["a"]):
        for e in core.step():
            events[e.request_id].append(e)
    assert not any(e.finish_reason for e in events["c"])  # c still holds its blocks
    core.add_request("b", "base", b, long_b)
    for rid, evs in drain(core).items():
        events[rid] += evs
    done = events["b"][-1]
    assert done.error is None and done.finish_reason is FinishReason.LENGTH, done.error
    assert len(tokens_of(events["b"])) == 24 and done.usage is not None and done.usage.cached_tokens == k * bs
    assert done.timeline is not None and done.timeline.queue_s > 0  # it waited for c's blocks


def test_a_prefill_is_chunked_while_others_decode_and_runs_whole_when_none_do(tiny_model_dir, smollm2_tokenizer):
    """``max_step_tokens`` bounds a step while requests decode; with nothing decoding the step
    may take ``max_prefill_step_tokens`` (a bigger chunk stalls nobody)."""
    core, _ = engine(tiny_model_dir, max_step_tokens=16, max_prefill_step_tokens=4096)
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Go."))
    assert len(prompt.token_ids) > 64
    core.add_request("a", "base", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    core.step()
    assert core.stats.prefill_tokens == len(prompt.token_ids)  # alone: one step
    other = chat_prompt(smollm2_tokenizer, [{"role": "user", "content": "Other: " + "a b c d. " * 30}], turn("Go."))
    core.add_request("b", "base", other, SamplingParams(temperature=0, max_tokens=2))
    before = core.stats.prefill_tokens
    core.step()
    assert core.stats.prefill_tokens - before == 15  # beside a decode: 16 tokens in all
    core, _ = engine(tiny_model_dir, max_step_tokens=16, max_prefill_step_tokens=8,  # never below max_step_tokens
                     prefill_tail_tokens=0)
    core.add_request("c", "base", prompt, SamplingParams(temperature=0, max_tokens=2))
    core.step()
    assert core.stats.prefill_tokens == 16
    with pytest.raises(ValueError, match="max_prefill_step_tokens"):
        EngineConfig(max_prefill_step_tokens=0)


def test_a_short_tail_of_a_prompt_joins_its_step_when_nothing_decodes(tiny_model_dir, smollm2_tokenizer):
    """With nothing decoding, a prompt whose rest exceeds the step's budget by at most
    ``prefill_tail_tokens`` is finished in that step; one tail token more and it is chunked at
    the budget. While a request decodes, ``max_step_tokens`` holds whatever the tail."""
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Go."))
    n = len(prompt.token_ids)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for tail, want in ((n - 64, n), (n - 64 - 1, 64)):
        core, logits = engine(tiny_model_dir, max_step_tokens=16, max_prefill_step_tokens=64, prefill_tail_tokens=tail)
        core.add_request("a", "base", prompt, params)
        core.step()
        assert core.stats.prefill_tokens == want, tail
        assert core.stats.steps == 1
    merged, chunked = engine(tiny_model_dir, max_step_tokens=16, max_prefill_step_tokens=64, prefill_tail_tokens=n), \
        engine(tiny_model_dir, max_step_tokens=16, max_prefill_step_tokens=64, prefill_tail_tokens=0)
    outs = []
    for core, logits in (merged, chunked):
        core.add_request("a", "base", prompt, params)
        ev = drain(core)["a"][-1]
        outs.append((ev.usage.completion_tokens, torch.stack(logits["a"])))
        core.add_request("b", "base", prompt, params)  # decodes while "c" prefills: 16 tokens a step
        core.step()
        other = [{"role": "user", "content": "Other: " + "a b c d. " * 30}]
        core.add_request("c", "base", chat_prompt(smollm2_tokenizer, other, turn("Go.")), params)
        before = core.stats.prefill_tokens
        core.step()
        assert core.stats.prefill_tokens - before == 15
    assert outs[0][0] == outs[1][0] == 4
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-4, rtol=1e-4)  # one step or two: the same logits
    with pytest.raises(ValueError, match="prefill_tail_tokens"):
        EngineConfig(prefill_tail_tokens=-1)


def test_plain_greedy_rows_are_picked_where_the_logits_are_and_only_their_ids_travel(tiny_model_dir, smollm2_tokenizer):
    """A step's plain greedy rows get their tokens from one argmax beside the logits; the host
    receives their ids, and whole rows only for the requests that read them (logprobs, a
    sampled draw). Every token equals what the per-row sampler gives (a logits hook turns the
    pick off: it must see each row)."""
    p = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 7?"))
    requests = {"g1": SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                "g2": SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop_token_ids=(3,)),
                "lp": SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2),
                "drawn": SamplingParams(temperature=0.8, seed=7, max_tokens=5, ignore_eos=True)}
    got = {}
    for hook in (True, False):
        core, _ = engine(tiny_model_dir)
        if not hook:
            core.logits_hook = None
        travelled: list[tuple[int, ...]] = []

        def to_host(t: torch.Tensor, travelled=travelled, real=core.runner.to_host) -> torch.Tensor:
            travelled.append(tuple(t.shape))
            return real(t)

        core.runner.to_host = to_host  # type: ignore[method-assign]
        for rid, params in requests.items():
            core.add_request(rid, "base", p, params)
        got[hook] = {rid: tokens_of(ev) for rid, ev in drain(core).items()}
        vocab = core.forward.weights.shape.vocab_size
        rows = [s[0] for s in travelled if s[1:] == (vocab,)]
        ids = [s for s in travelled if len(s) == 1]
        if hook:
            assert not ids and sum(rows) == 4 * 5  # every sampled token's row came to the host
        else:
            assert sum(rows) == 2 * 5  # only lp's and drawn's rows
            assert sum(n for (n,) in ids) == 2 * 5 and max(ids) <= (2,)  # g1's and g2's ids, one copy per step
    assert got[True] == got[False] and all(len(t) == 5 for t in got[True].values())


def test_a_greedy_row_holding_a_nan_travels_whole_and_is_sampled_as_before(tiny_model_dir):
    core, _ = engine(tiny_model_dir)
    logits = torch.tensor([[0.0, 3.0, 1.0], [float("nan"), 1.0, 2.0], [5.0, 1.0, 5.0], [9.0, 0.0, 0.0]])
    out = core.runner._to_host(logits, [0, 1, 2, 3], [True, True, True, False])
    assert out[0] == 1 and out[2] == 0  # the first of equal maxima
    assert isinstance(out[1], torch.Tensor) and out[1].isnan().any()  # sample() reads NaN as -inf
    assert isinstance(out[3], torch.Tensor) and torch.equal(out[3], logits[3])
