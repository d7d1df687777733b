"""Decode steps from graphs (``server/engine/graphs.py``), on the CPU: the padded step (mode
``padded``, what a CUDA graph captures) equals the eager one, and a capture that fails turns
graphs off and leaves the answers as they were. The capture itself runs in tests/cuda."""

from __future__ import annotations

import logging

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
    base = random_hf_model(tiny_shape(), dtype=torch.float32, seed=0)
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


def test_a_capture_that_fails_turns_graphs_off_and_the_step_runs_eagerly(parts, caplog):
    """No CUDA here: the capture raises, as it would on an op a graph cannot hold."""
    _, eager, _ = run(parts, "off")
    with caplog.at_level(logging.WARNING, logger="agentshare.engine"):
        core, tokens, _ = run(parts, "padded", then="cuda")
    assert tokens == eager
    assert core.runner.graphs is not None and core.runner.graphs.mode == "off"
    assert any(getattr(r, "event", None) == "decode_graph" and "capture failed" in r.why for r in caplog.records)


class _ReplayOnTheCPU:
    """A stand-in for a captured CUDA graph: its replay recomputes the padded step into the
    captured output buffer, as a graph writes its outputs in place (``off``: adds an error)."""

    def __init__(self, graphs, g, off: float) -> None:
        self.graphs, self.g, self.off = graphs, g, off

    def replay(self) -> None:
        out = self.graphs.forward(self.g.plan, self.graphs.kv, projection=self.g.projection)
        self.g.out.copy_(out + self.off)


@pytest.mark.parametrize("off", [0.0, 0.5], ids=["agrees", "differs"])
def test_each_graph_is_checked_against_the_eager_step_on_its_first_replay(parts, caplog, monkeypatch, off):
    from server.engine import graphs as graphs_module

    def capture(self, g):
        g.out = self.forward(g.plan, self.kv, projection=g.projection).clone()
        g.graph = _ReplayOnTheCPU(self, g, off)
        self.captures += 1

    monkeypatch.setattr(graphs_module.DecodeGraphs, "_capture", capture)
    _, eager, eager_rows = run(parts, "off")
    with caplog.at_level(logging.WARNING, logger="agentshare.engine"):
        core, tokens, rows = run(parts, "padded", then="cuda")
    graphs = core.runner.graphs
    assert graphs is not None and tokens == eager  # a graph that differs never served a token
    for rid, want in eager_rows.items():
        assert torch.allclose(torch.stack(rows[rid]), torch.stack(want), atol=1e-5)
    if off:
        assert graphs.mode == "off" and graphs.captures == 1 and graphs.replays == 1
        assert any("differs from the eager step" in getattr(r, "why", "") for r in caplog.records)
    else:
        assert graphs.mode == "cuda" and graphs.captures == len(graphs._graphs) >= 2 and graphs.replays > graphs.captures
        assert all(g.checked for g in graphs._graphs.values())


def test_the_mode_is_checked():
    with pytest.raises(ValueError, match="decode_graphs is auto, off or padded"):
        EngineConfig(decode_graphs="always")
