"""Decode steps from graphs (``server/engine/graphs.py``), on the CPU: the padded step (mode
``padded``, what a CUDA graph captures) equals the eager one, and a capture that fails turns
graphs off and leaves the answers as they were. The capture itself runs in tests/cuda."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from server.engine.config import EngineConfig
from server.engine.core import EngineCore
from server.engine.forward import LlamaForward
from server.engine.graphs import WIDTH, bucket, width_bucket
from server.engine.modules import DecodeModule, base_module
from server.engine.sampling import SamplingParams
from server.engine.synthetic import IdDecoder, random_hf_model, random_lora, tiny_shape
from server.prompt import Prompt


@pytest.fixture(scope="module")
def parts():
    # one KV head of six query heads: a mask laid out on the wrong axis cannot broadcast by luck
    base = random_hf_model(tiny_shape(hidden_size=96, num_attention_heads=6, num_key_value_heads=1), dtype=torch.float32, seed=0)
    forward = LlamaForward.from_hf(base, dtype=torch.float32)
    modules = {"base": base_module("tiny")}
    for i in range(2):
        modules[f"a{i}"] = DecodeModule(f"a{i}", "lora", f"tiny-a{i}", True,
                                        weights=random_lora(forward, rank=4, seed=i + 1, std=0.1))
    return forward, modules


def run(parts, mode: str, *, lengths=(5, 9, 14), agents=("base", "a0", "a1", "a0"),
        then: str | None = None) -> tuple[EngineCore, dict, dict]:
    """A team on one pinned context; ``then``: the graphs' mode once built."""
    forward, modules = parts
    core = EngineCore(forward, IdDecoder(), family="tiny", modules=modules,
                      config=EngineConfig(kv_cache_bytes=8 << 20, decode_graphs=mode))
    if then is not None:
        assert core.runner.graphs is not None
        core.runner.graphs.mode = then
    rows: dict[str, list[torch.Tensor]] = {}
    core.logits_hook = lambda rid, row: rows.setdefault(rid, []).append(row.clone())
    context = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    core.add_context("ctx", context, ttl=60)
    while core.has_work:
        core.step()
    for i, name in enumerate(agents):  # requests that end at different steps: the batch shrinks
        ids = tuple(context + [7 + i, 8, 9])
        core.add_request(f"r{i}", name, Prompt(ids, 40, 40, len(ids)),
                         SamplingParams(temperature=0, max_tokens=lengths[i % len(lengths)], ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while core.has_work:
        for e in core.step():
            if e.token_id is not None:
                tokens.setdefault(e.request_id, []).append(e.token_id)
    return core, tokens, rows


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 17, 64)] == [1, 2, 4, 8, 32, 64]
    assert bucket(65) is None
    assert width_bucket(WIDTH) == WIDTH and width_bucket(WIDTH + 1) == 2 * WIDTH


def test_padded_decode_steps_equal_the_eager_ones(parts):
    eager_core, eager, eager_rows = run(parts, "off")
    core, padded, padded_rows = run(parts, "padded")
    assert padded == eager
    assert core.runner.graphs is not None and core.runner.graphs.replays > 0  # graphs served steps
    assert eager_core.runner.graphs is None
    for rid, want in eager_rows.items():
        got = torch.stack(padded_rows[rid])
        assert torch.allclose(got, torch.stack(want), atol=1e-5), (rid, (got - torch.stack(want)).abs().max())
    # one block, past every request's, takes the padding rows' writes
    assert core.pool.usage().free == eager_core.pool.usage().free - 1


def test_a_width_past_one_bucket_gets_a_graph_of_its_own(parts):
    _, eager, _ = run(parts, "off", lengths=(WIDTH + 10,), agents=("a0", "a1"))
    core, padded, _ = run(parts, "padded", lengths=(WIDTH + 10,), agents=("a0", "a1"))
    assert padded == eager
    widths = {key[1] for key in core.runner.graphs._graphs}  # type: ignore[union-attr]
    assert widths == {WIDTH, 2 * WIDTH}


def test_a_capture_error_is_logged_with_its_type_and_message(parts, caplog, monkeypatch):
    from server.engine import graphs as graphs_module

    def refuse(step, *, device, pool, before):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_module, "capture_graph", refuse)
    monkeypatch.setattr(graphs_module, "new_graph_pool", object)
    _, eager, _ = run(parts, "off")
    with caplog.at_level(logging.WARNING, logger="agentshare.engine"):
        _, tokens, _ = run(parts, "padded", then="cuda")
    assert tokens == eager
    why = [r.why for r in caplog.records if getattr(r, "event", None) == "decode_graph"]
    assert why == ["capture failed: RuntimeError: operation not permitted when stream is capturing"]


def test_a_capture_that_fails_turns_graphs_off_and_the_step_runs_eagerly(parts, caplog):
    """No CUDA here: the capture raises, as it would on an op a graph cannot hold."""
    _, eager, _ = run(parts, "off")
    with caplog.at_level(logging.WARNING, logger="agentshare.engine"):
        core, tokens, _ = run(parts, "padded", then="cuda")
    assert tokens == eager
    assert core.runner.graphs is not None and core.runner.graphs.mode == "off"
    why = [r.why for r in caplog.records if getattr(r, "event", None) == "decode_graph"]
    assert why and re.match(r"capture failed: \w+: ", why[0]), why


class _ReplayOnTheCPU:
    """A stand-in for a captured CUDA graph: its replay runs the captured step again into the
    captured output buffer, as a graph writes its outputs in place (``off``: adds an error)."""

    def __init__(self, step, out, off: float | str | None) -> None:
        self.step, self.out, self.off = step, out, off

    def replay(self) -> None:
        fresh = self.step()
        if self.off == "rows":  # each row gets the next row's logits, as a stale row map would give
            self.out.copy_(fresh.roll(1, 0))
            return
        # None: an error of half the tolerance (1e-4 of the largest logit, fp32), which must pass
        off = 0.5e-4 * float(fresh.abs().max()) if self.off is None else self.off
        self.out.copy_(fresh + off)


def fake_capture(monkeypatch, off: float | str | None) -> tuple[list, list]:
    """``capture_graph`` and the graph pool replaced by the CPU stand-in; returns the pools made
    and what each capture was asked to drop first."""
    from server.engine import graphs as graphs_module

    pools: list = []
    befores: list = []
    original_run = graphs_module.DecodeGraphs.run

    def capture(step, *, device, pool, before):
        assert device == torch.device("cpu") and pool is pools[-1]
        step()  # the warm-up
        before()
        befores.append(before)
        out = step().clone()
        return _ReplayOnTheCPU(step, out, off), out

    def rows_of_the_step(self, plan, row_modules, eager):
        out = original_run(self, plan, row_modules, eager)
        assert out is None or out.shape[0] == plan.num_tokens
        return out

    monkeypatch.setattr(graphs_module, "capture_graph", capture)
    monkeypatch.setattr(graphs_module, "new_graph_pool", lambda: pools.append(object()) or pools[-1])
    monkeypatch.setattr(graphs_module.DecodeGraphs, "run", rows_of_the_step)
    return pools, befores


@pytest.mark.parametrize("off", ["agrees", "within", "differs"])
@pytest.mark.parametrize("agents", [("base", "a0", "a1"), ("base", "base")], ids=["lora", "base"])  # 3 rows: padded
def test_each_graph_is_checked_against_the_eager_step_on_its_first_replay(parts, caplog, monkeypatch, off, agents):
    pools, befores = fake_capture(monkeypatch, {"agrees": 0.0, "within": None, "differs": 0.5}[off])
    _, eager, eager_rows = run(parts, "off", agents=agents)
    with caplog.at_level(logging.WARNING, logger="agentshare.engine"):
        core, tokens, rows = run(parts, "padded", then="cuda", agents=agents)
    graphs = core.runner.graphs
    assert graphs is not None and tokens == eager  # a graph that differs never served a token
    assert graphs.tolerance == 1e-4  # fp32
    biggest = max(float(torch.stack(w).abs().max()) for w in eager_rows.values())
    assert biggest > 2  # so an error relative to it is not one relative to 1
    for rid, want in eager_rows.items():
        assert torch.allclose(torch.stack(rows[rid]), torch.stack(want), atol=1e-4 * biggest)
    if off == "differs":
        assert graphs.mode == "off" and graphs.captures == 1 and graphs.replays == 1
        assert any("differs from the eager step" in getattr(r, "why", "") for r in caplog.records)
    else:
        assert graphs.mode == "cuda" and graphs.captures == len(graphs._graphs) >= 2
        assert sum(g.replays for g in graphs._graphs.values()) == graphs.replays
        assert graphs.replays > graphs.captures and all(g.checked for g in graphs._graphs.values())
        assert len(pools) == 1  # one pool for every graph of the engine
        # a graph with LoRA rows drops its row masks before capture: it makes them itself
        with_lora = {id(g.projection) for g in graphs._graphs.values() if g.projection is not None}
        assert {id(getattr(b, "__self__", None)) for b in befores} - {id(None)} == with_lora
        assert bool(with_lora) == (agents != ("base", "base"))


def test_the_mode_is_checked():
    with pytest.raises(ValueError, match="decode_graphs is auto, off or padded"):
        EngineConfig(decode_graphs="always")


def _plan(*chunks):
    """Chunks as (ids, start, prefix tokens[, the prefix's first block])."""
    from server.engine.batch import Chunk, SharedPrefix, plan_step

    made = [Chunk(c[0], start=c[1], slots=torch.arange(100, 100 + c[1] + len(c[0]) - c[2]),
                  prefix=SharedPrefix(c[3] if len(c) > 3 else 0, c[2]) if c[2] else None) for c in chunks]
    return plan_step(made, block_size=16)


def test_only_steps_of_decoding_rows_over_a_few_prefixes_are_graphable():
    from server.engine.graphs import MAX_PREFIXES, graphable

    assert graphable(_plan(([5], 20, 16), ([6], 30, 16)))
    assert graphable(_plan(([5], 20, 0)))
    assert graphable(_plan(([5], 20, 16), ([6], 30, 0)))  # one row reads the prefix, one does not
    assert graphable(_plan(*[([5], 20, 16, b) for b in range(MAX_PREFIXES)]))  # each row its own prefix
    assert not graphable(_plan(*[([5], 20, 16, b) for b in range(MAX_PREFIXES + 1)]))
    assert not graphable(_plan(([5, 6], 20, 16)))  # a prefill chunk
    assert not graphable(_plan(([5], 20, 16), ([6, 7], 30, 16)))  # decode and a chunk
    assert not graphable(_plan(*[([5], 20, 16)] * 65))  # more rows than the largest bucket


def two_teams(parts, mode: str, *, meta: bool = False) -> tuple[EngineCore, dict, dict]:
    """Rows over two pinned contexts (another tenant's, too) and one over none, decoding
    together, ending at different steps: every step reads several prefixes. ``meta``: the
    weights are on the meta device, and the logits' copy gives zeros (see test_device.py)."""
    forward, modules = parts
    core = EngineCore(forward, IdDecoder(), family="tiny", modules=modules,
                      config=EngineConfig(kv_cache_bytes=8 << 20, decode_graphs=mode))
    if meta:
        core.runner.to_host = lambda t: torch.zeros(t.shape, dtype=t.dtype)  # type: ignore[method-assign]
    rows: dict[str, list[torch.Tensor]] = {}
    core.logits_hook = lambda rid, row: rows.setdefault(rid, []).append(row.clone())
    g = torch.Generator().manual_seed(4)
    contexts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (40, 56)]
    for i, ctx in enumerate(contexts):
        core.add_context(f"ctx{i}", ctx, ttl=60)
    core.add_context("ctx0-other", contexts[0], ttl=60, salt="other-tenant")
    while core.has_work:
        core.step()
    plan = [("r0", "base", 0, None, 5), ("r1", "a0", 1, None, 9), ("r2", "a1", 0, "other-tenant", 14),
            ("r3", "a0", 1, None, 7), ("r4", "base", None, None, 11)]
    for rid, module, ctx, salt, n in plan:
        context = contexts[ctx] if ctx is not None else []
        turn = torch.randint(3, 250, (6,), generator=g).tolist()
        ids = tuple(context + turn)
        core.add_request(rid, module, Prompt(ids, len(context), len(context), len(ids)),
                         SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), salt=salt or "")
    tokens: dict[str, list[int]] = {}
    while core.has_work:
        for e in core.step():
            assert e.error is None, e.error
            if e.token_id is not None:
                tokens.setdefault(e.request_id, []).append(e.token_id)
    return core, tokens, rows


def test_the_prefixes_membership_masks_stay_on_the_engines_device():
    meta = torch.device("meta")
    forward = LlamaForward.from_hf(random_hf_model(tiny_shape(), dtype=torch.float32, seed=0), device=meta)
    modules = {"base": base_module("tiny")}
    for i in range(2):
        modules[f"a{i}"] = DecodeModule(f"a{i}", "lora", f"tiny-a{i}", True, weights=random_lora(forward, rank=4, seed=i))
    core, tokens, _ = two_teams((forward, modules), "padded", meta=True)
    assert len(tokens) == 5 and core.runner.graphs.replays > 0  # type: ignore[union-attr]
    assert max(g.replays for key, g in core.runner.graphs._graphs.items() if len(key[2]) == 3) > 0  # type: ignore[union-attr]
    members = [g.member for graph in core.runner.graphs._graphs.values()  # type: ignore[union-attr]
               for g in graph.plan.prefix_groups if g.member is not None]
    assert members and all(m.device == meta for m in members)


def test_rows_over_several_prefixes_replay_graphs_and_equal_the_eager_steps(parts):
    _, eager, eager_rows = two_teams(parts, "off")
    core, padded, padded_rows = two_teams(parts, "padded")
    assert padded == eager and len(eager) == 5
    for rid, want in eager_rows.items():
        got = torch.stack(padded_rows[rid])
        assert torch.allclose(got, torch.stack(want), atol=1e-5), (rid, (got - torch.stack(want)).abs().max())
    graphs = core.runner.graphs
    assert graphs is not None and graphs.replays > 0
    assert sum(g.replays for g in graphs._graphs.values()) == graphs.replays  # each step counted once, by its graph
    three = sum(g.replays for key, g in graphs._graphs.items() if len(key[2]) == 3)
    assert three >= 4  # steps over two contexts and the other tenant's copy of one


def test_a_decode_graph_mode_is_one_of_three(parts):
    from server.engine.graphs import DecodeGraphs

    forward, _ = parts
    for mode in ("cuda", "padded", "off"):
        assert DecodeGraphs(forward, None, None, scratch_slot=0, mode=mode, tolerance=1e-4).mode == mode
    with pytest.raises(ValueError, match="cuda, padded or off"):
        DecodeGraphs(forward, None, None, scratch_slot=0, mode="on", tolerance=1e-4)


def test_a_row_that_changes_module_within_one_graph_gets_its_new_modules_deltas(parts):
    """[a0, base, a0, base]; when the first ends, [base, a0, base] stay in the bucket of four
    with the same module set, but every row is another request's."""
    kw = dict(agents=("a0", "base", "a0", "base"), lengths=(4, 12, 12, 12))
    _, eager, _ = run(parts, "off", **kw)
    core, padded, _ = run(parts, "padded", **kw)
    assert padded == eager
    assert len(core.runner.graphs._graphs) == 1  # type: ignore[union-attr]  # all of it in one graph


def teams(parts, mode: str, rounds) -> tuple[EngineCore, list[dict]]:
    """Teams one after another on one engine: ``rounds`` of (context seed, agents)."""
    forward, modules = parts
    core = EngineCore(forward, IdDecoder(), family="tiny", modules=modules,
                      config=EngineConfig(kv_cache_bytes=8 << 20, decode_graphs=mode))
    out = []
    for n, (seed, agents) in enumerate(rounds):
        context = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
        core.add_context(f"ctx{n}", context, ttl=60)
        while core.has_work:
            core.step()
        for i, name in enumerate(agents):
            ids = tuple(context + [7 + i, 8])
            core.add_request(f"{n}-{i}", name, Prompt(ids, 40, 40, len(ids)),
                             SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        while core.has_work:
            for e in core.step():
                if e.token_id is not None:
                    tokens.setdefault(e.request_id, []).append(e.token_id)
        out.append(tokens)
    return core, out


def test_a_graph_serves_only_its_own_prefix_and_module_set(parts):
    rounds = [(1, ("a0", "base")), (2, ("a1", "base")), (1, ("a1", "a0"))]
    _, eager = teams(parts, "off", rounds)
    core, padded = teams(parts, "padded", rounds)
    assert padded == eager
    keys = list(core.runner.graphs._graphs)  # type: ignore[union-attr]
    assert len(keys) == 3 and len({k[2] for k in keys}) == 2 and len({k[3] for k in keys}) == 3


def test_graphs_are_bounded_and_the_least_recently_replayed_goes_first(parts, monkeypatch):
    from server.engine import graphs as graphs_module

    monkeypatch.setattr(graphs_module, "MAX_GRAPHS", 2)
    core, _ = teams(parts, "padded", [(1, ("a0", "base")), (2, ("a1", "base")), (3, ("a0", "a1"))])
    starts = [k[2][0][0] for k in core.runner.graphs._graphs]  # type: ignore[union-attr]
    first = [core.contexts[f"ctx{n}"].block_ids[0] * 16 for n in range(3)]  # each round's prefix slot
    assert starts == first[1:]  # the first round's graph went; the newest stayed


def test_every_graphable_step_is_served_by_a_graph_with_its_own_rows(parts, monkeypatch):
    from server.engine import graphs as graphs_module

    seen = {"graphable": 0}
    original_graphable, original_run = graphs_module.graphable, graphs_module.DecodeGraphs.run

    def counted(plan):
        ok = original_graphable(plan)
        seen["graphable"] += ok
        return ok

    def checked(self, plan, row_modules, eager):
        out = original_run(self, plan, row_modules, eager)
        assert out is None or out.shape[0] == plan.num_tokens
        return out

    monkeypatch.setattr(graphs_module, "graphable", counted)
    monkeypatch.setattr(graphs_module.DecodeGraphs, "run", checked)
    core, _, _ = run(parts, "padded")
    assert core.runner.graphs.replays == seen["graphable"] > 0  # type: ignore[union-attr]


def test_a_position_past_the_context_is_refused_before_the_graph_runs(parts):
    forward, modules = parts
    core = EngineCore(forward, IdDecoder(), family="tiny", modules=modules,
                      config=EngineConfig(kv_cache_bytes=8 << 20, decode_graphs="padded"))
    limit = forward.weights.shape.max_context
    with pytest.raises(ValueError, match=f"position {limit} beyond the context of {limit}"):
        core.runner.graphs.run(_plan(([5], limit, 0)), None, lambda: None)  # type: ignore[union-attr]
    assert core.runner.graphs.run(_plan(([5], limit - 1, 0)), None, lambda: None).shape[0] == 1  # type: ignore[union-attr]


def test_padded_steps_keep_every_buffer_on_the_engines_device(monkeypatch):
    """On the meta device (see test_device.py): a buffer made on the host fails the step."""
    meta = torch.device("meta")
    forward = LlamaForward.from_hf(random_hf_model(tiny_shape(), dtype=torch.float32, seed=0), device=meta)
    modules = {"base": base_module("tiny"),
               "a0": DecodeModule("a0", "lora", "tiny-a0", True, weights=random_lora(forward, rank=4, seed=1))}
    core = EngineCore(forward, IdDecoder(), family="tiny", modules=modules,
                      config=EngineConfig(kv_cache_bytes=8 << 20, decode_graphs="padded"))
    core.runner.to_host = lambda t: torch.zeros(t.shape, dtype=t.dtype)  # type: ignore[method-assign]
    for i, name in enumerate(("a0", "base", "a0")):
        core.add_request(f"r{i}", name, Prompt(tuple(range(10, 40)), 20, 20, 30),
                         SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    failed = []
    while core.has_work:
        failed += [e.error for e in core.step() if e.error]
    assert not failed and core.runner.graphs.replays > 0  # type: ignore[union-attr]
    # the row map too (a CPU one passes some meta ops, and would fail on a GPU)
    maps = [g.projection._row_slot for g in core.runner.graphs._graphs.values() if g.projection is not None]  # type: ignore[union-attr]
    assert maps and all(m.device == meta for m in maps)


def test_a_new_base_forward_drops_the_graphs_of_the_old_one(parts):
    core, _, _ = run(parts, "padded")
    graphs = core.runner.graphs
    assert graphs is not None and graphs._graphs
    replaced = LlamaForward(core.forward.weights, core.forward.rope)
    core.forward = replaced
    ids = tuple(range(10, 50))
    core.add_request("x", "a0", Prompt(ids, 30, 30, 40), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while core.has_work:
        core.step()
    assert graphs.forward is replaced  # and only the new request's graphs are left: one row of a0
    assert graphs._graphs and all(k[0] == 1 and k[3] == (0,) for k in graphs._graphs)


@pytest.mark.parametrize("fault", ["none", "rows"])
def test_in_bf16_the_check_lets_rounding_pass_and_catches_a_replay_that_serves_another_rows_logits(
        caplog, monkeypatch, fault):
    """bf16 moves a padded step's logits a little (replay_tolerance); a graph whose rows are
    another row's is still caught, and never serves a token."""
    base = random_hf_model(tiny_shape(hidden_size=96, num_attention_heads=6, num_key_value_heads=1),
                           dtype=torch.float32, seed=0)
    forward = LlamaForward.from_hf(base, dtype=torch.bfloat16)
    modules = {"base": base_module("tiny")}
    for i in range(2):
        modules[f"a{i}"] = DecodeModule(f"a{i}", "lora", f"tiny-a{i}", True,
                                        weights=random_lora(forward, rank=4, seed=i + 1, std=0.1))
    bf16 = (forward, modules)
    fake_capture(monkeypatch, 0.0 if fault == "none" else "rows")
    _, eager, _ = run(bf16, "off", agents=("base", "a0", "a1"))
    with caplog.at_level(logging.WARNING, logger="agentshare.engine"):
        core, tokens, _ = run(bf16, "padded", then="cuda", agents=("base", "a0", "a1"))
    graphs = core.runner.graphs
    assert graphs is not None and graphs.tolerance == 0.1
    assert tokens == eager
    why = [r.why for r in caplog.records if getattr(r, "event", None) == "decode_graph"]
    if fault == "none":
        assert graphs.mode == "cuda" and not why and graphs.replays > graphs.captures
    else:
        assert graphs.mode == "off" and len(why) == 1 and "differs from the eager step" in why[0]


def test_a_graph_made_while_one_row_read_no_prefix_serves_the_steps_after_it_ends(parts):
    """Rows [ctx, none, ctx, ctx]: the prefix's rows are a mask. When the row without a prefix
    ends, [ctx, ctx, ctx] stay in the bucket of four, under the same key: the mask now covers
    every row."""
    forward, modules = parts
    context = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    out = {}
    for mode in ("off", "padded"):
        core = EngineCore(forward, IdDecoder(), family="tiny", modules=modules,
                          config=EngineConfig(kv_cache_bytes=8 << 20, decode_graphs=mode))
        rows: dict[str, list[torch.Tensor]] = {}
        core.logits_hook = lambda rid, row, rows=rows: rows.setdefault(rid, []).append(row.clone())
        core.add_context("ctx", context, ttl=60)
        while core.has_work:
            core.step()
        for i in range(4):
            own = [] if i == 1 else context
            ids = tuple(own + [7 + i, 8, 9])
            core.add_request(f"r{i}", "a0", Prompt(ids, len(own), len(own), len(ids)),
                             SamplingParams(temperature=0, max_tokens=3 if i == 1 else 9, ignore_eos=True))
        while core.has_work:
            core.step()
        out[mode] = (rows, core.runner.graphs)
    (want, _), (got, graphs) = out["off"], out["padded"]
    for rid in want:
        assert torch.allclose(torch.stack(got[rid]), torch.stack(want[rid]), atol=1e-5), rid
    assert len(graphs._graphs) == 1  # type: ignore[union-attr]  # one key: four rows, one prefix
    (graph,) = graphs._graphs.values()  # type: ignore[union-attr]
    assert graph.plan.prefix_groups[0].member is not None and graph.replays >= 8
