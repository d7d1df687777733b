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
from server.models.synthetic import IdDecoder, random_hf_model, random_lora, tiny_shape
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


def test_the_mode_is_checked():
    with pytest.raises(ValueError, match="decode_graphs is auto, off or padded"):
        EngineConfig(decode_graphs="always")
