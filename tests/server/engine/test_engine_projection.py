"""The projection seam: per-row module deltas touch only their rows, base rows stay exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from server.engine.batch import Chunk, plan_step
from server.engine.forward import LlamaForward
from server.engine.projection import LowRank, RowDeltaProjection
from server.kv.storage import KVStorage


def test_row_delta_projection_touches_only_its_rows_and_slice() -> None:
    from server.engine.weights import Linear

    g = torch.Generator().manual_seed(0)
    lin = Linear(torch.randn(12, 8, generator=g), torch.randn(12, generator=g))
    x = torch.randn(5, 8, generator=g)
    a, b = torch.randn(2, 8, generator=g), torch.randn(4, 2, generator=g)
    rows = torch.tensor([-1, 0, 1, 0, -1])
    proj = RowDeltaProjection(rows, {(0, 3, "qkv"): [LowRank(a, b, scale=0.5, col=4)]})
    got = proj(x, lin, layer=3, name="qkv")
    base = x @ lin.weight.T + lin.bias
    want = base.clone()
    want[[1, 3], 4:8] += 0.5 * (x[[1, 3]] @ a.T @ b.T)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(proj(x, lin, layer=2, name="qkv"), base)  # other layer: no delta


def test_forward_with_module_rows_changes_only_rows_at_or_after_the_switch(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    fwd = LlamaForward.from_hf(model)
    s = fwd.weights.shape
    ids = torch.randint(0, s.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    deltas = {
        (0, layer, "qkv"): [LowRank(torch.randn(4, s.hidden_size, generator=g),
                                    torch.randn(s.q_size, 4, generator=g) * 0.1)]
        for layer in range(s.num_layers)
    }
    rows = torch.tensor([-1] * 7 + [0] * 5)  # positions >= 7 use "the module"

    def run(projection=None) -> torch.Tensor:
        kv = KVStorage(fwd.kv_spec(), num_blocks=2, block_size=16)
        plan = plan_step([Chunk(ids, start=0, slots=torch.arange(12))], block_size=16, all_logits=True)
        return fwd(plan, kv, projection=projection)

    base, mixed = run(), run(RowDeltaProjection(rows, deltas))
    torch.testing.assert_close(mixed[:7], base[:7], atol=0, rtol=0)  # causal: earlier rows exact
    assert (mixed[7:] - base[7:]).abs().max() > 1e-2


def _module_updates(g: torch.Generator, rank: int, cols: tuple[int, ...]) -> list[LowRank]:
    return [LowRank(torch.randn(rank, 8, generator=g), torch.randn(4, rank, generator=g), scale=0.5 + c / 8, col=c)
            for c in cols]


def test_several_modules_in_one_step_each_row_gets_its_own_deltas_only() -> None:
    """Three modules of different ranks and targets, rows interleaved: each row equals the base
    plus its own module's updates, computed one module at a time."""
    from server.engine.weights import Linear

    g = torch.Generator().manual_seed(3)
    lin = Linear(torch.randn(12, 8, generator=g), torch.randn(12, generator=g))
    deltas = {
        (0, 0, "qkv"): _module_updates(g, 2, (0, 4)),
        (1, 0, "qkv"): _module_updates(g, 4, (8,)),
        (2, 0, "qkv"): _module_updates(g, 3, (4,)),
        (2, 1, "qkv"): _module_updates(g, 3, (0,)),  # only module 2 on layer 1
    }
    rows = torch.tensor([2, -1, 0, 1, 2, 0, -1, 1])
    x = torch.randn(len(rows), 8, generator=g)
    proj = RowDeltaProjection(rows, deltas)
    for layer in (0, 1, 2):
        want = x @ lin.weight.T + lin.bias
        for i, m in enumerate(rows.tolist()):
            for u in deltas.get((m, layer, "qkv"), []) if m >= 0 else []:
                want[i, u.col : u.col + 4] += u.scale * (x[i] @ u.a.T @ u.b.T)
        torch.testing.assert_close(proj(x, lin, layer=layer, name="qkv"), want)


def test_lora_bank_keeps_a_bounded_number_of_module_sets() -> None:
    from server.engine.projection import LoraBank
    from server.engine.weights import Linear

    g = torch.Generator().manual_seed(4)
    bank = LoraBank()
    for m in range(LoraBank.max_sets + 3):
        bank.add(m, 0, "o", _module_updates(g, 2, (0,)))
    lin = Linear(torch.zeros(4, 8))
    x = torch.ones(1, 8)
    outs = {}
    for m in range(LoraBank.max_sets + 3):  # one set per step, more sets than are kept
        outs[m] = RowDeltaProjection(torch.tensor([m]), bank)(x, lin, layer=0, name="o")
    assert len(bank._sets) == LoraBank.max_sets
    for m, out in outs.items():  # a set rebuilt after eviction gives the same rows
        torch.testing.assert_close(RowDeltaProjection(torch.tensor([m]), bank)(x, lin, layer=0, name="o"), out)


@pytest.mark.parametrize("rows", [3, 200])  # a decode step (fp32 low-rank product) and a prefill (bf16)
def test_bf16_rows_get_their_modules_deltas_on_both_paths(rows: int) -> None:
    from server.engine.weights import Linear

    g = torch.Generator().manual_seed(5)
    lin = Linear(torch.randn(12, 8, generator=g))
    deltas = {(m, 0, "qkv"): _module_updates(g, 4, (0, 8)) for m in range(3)}
    modules = torch.randint(-1, 3, (rows,), generator=g)
    x = torch.randn(rows, 8, generator=g)
    got = RowDeltaProjection(modules, {k: [LowRank(u.a.bfloat16(), u.b.bfloat16(), u.scale, u.col) for u in v]
                                       for k, v in deltas.items()})(x.bfloat16(), Linear(lin.weight.bfloat16()),
                                                                     layer=0, name="qkv")
    want = x.double() @ lin.weight.double().T
    for i, m in enumerate(modules.tolist()):
        for u in deltas.get((m, 0, "qkv"), []) if m >= 0 else []:
            want[i, u.col : u.col + 4] += u.scale * (x[i].double() @ u.a.double().T @ u.b.double().T)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0.1, rtol=0.02)


def test_a_module_set_is_stacked_once_and_the_least_recently_used_set_goes_first() -> None:
    """A team's set recurs step after step: its stacks and row masks are built once; when more
    sets than :attr:`LoraBank.max_sets` come, the one unused for longest is dropped."""
    from server.engine.projection import LoraBank

    g = torch.Generator().manual_seed(6)
    bank = LoraBank()
    for m in range(LoraBank.max_sets + 1):
        bank.add(m, 0, "o", _module_updates(g, 2, (0,)))
    first = bank.stack((0,), 0, "o")
    assert first is not None and bank.stack((0,), 0, "o") is first  # built once
    for m in range(1, LoraBank.max_sets):
        bank.stack((m,), 0, "o")
    bank.stack((0,), 0, "o")  # set (0,) used again: now the most recent
    bank.stack((LoraBank.max_sets,), 0, "o")  # one set too many: (1,) goes, (0,) stays
    assert (0,) in bank._sets and (1,) not in bank._sets and bank.stack((0,), 0, "o") is first
    proj = RowDeltaProjection(torch.tensor([0, -1]), bank)
    assert proj._mask(first.owner, torch.float32) is proj._mask(first.owner, torch.float32)  # once per step


def test_rows_pointed_at_other_modules_in_place_compute_as_a_fresh_projection() -> None:
    """``set_rows`` (a captured decode graph reads the row map where it is): after it, the
    same object computes what a projection built for the new rows computes, and its row map
    stayed the same tensor."""
    from server.engine.weights import Linear

    g = torch.Generator().manual_seed(4)
    lin = Linear(torch.randn(12, 8, generator=g))
    deltas = {(m, 0, "o"): _module_updates(g, 2, (0,)) for m in (0, 1)}
    x = torch.randn(4, 8, generator=g)
    proj = RowDeltaProjection(torch.tensor([0, 1, -1, 0]), deltas)
    assert proj.modules == (0, 1)
    proj(x, lin, layer=0, name="o")  # its masks are cached now
    kept = proj._row_slot
    moved = torch.tensor([1, -1, 0, 1])
    proj.set_rows(moved)
    assert proj._row_slot is kept and proj._row_slot.tolist() == [1, -1, 0, 1]
    torch.testing.assert_close(proj(x, lin, layer=0, name="o"), RowDeltaProjection(moved, deltas)(x, lin, layer=0, name="o"))
    assert proj.slots_of(torch.tensor([-1, 1])).tolist() == [-1, 1]


def test_the_row_map_goes_to_the_device_it_is_asked_for() -> None:
    proj = RowDeltaProjection(torch.tensor([0, -1]), {}, torch.device("meta"))
    assert proj._row_slot.device.type == "meta" and proj.modules == (0,)


def test_a_layer_split_projection_gives_each_layer_the_part_that_starts_at_or_below_it() -> None:
    """Parts from layers 0 and 2: layers 0-1 take the first, 2 and deeper the second, and the
    lm_head (layer -1) the deepest; each gets the call's own arguments."""
    from server.engine.projection import LayerSplitProjection
    from server.engine.weights import Linear

    calls = []

    def part(tag: float):
        def project(x, linear, *, layer, name):
            calls.append((tag, layer, name, linear))
            return x + tag
        return project

    lin = Linear(torch.eye(2))
    split = LayerSplitProjection(((0, part(1.0)), (2, part(10.0))))
    x = torch.zeros(1, 2)
    got = [float(split(x, lin, layer=i, name=f"p{i}")[0, 0]) for i in (0, 1, 2, 3, -1)]
    assert got == [1.0, 1.0, 10.0, 10.0, 10.0]
    assert [(layer, name) for _, layer, name, _ in calls] == [(0, "p0"), (1, "p1"), (2, "p2"), (3, "p3"), (-1, "p-1")]
    assert all(linear is lin for *_, linear in calls)
    three = LayerSplitProjection(((0, part(1.0)), (1, part(5.0)), (3, part(7.0))))
    assert [float(three(x, lin, layer=i, name="o")[0, 0]) for i in (0, 1, 2, 3, -1)] == [1.0, 5.0, 5.0, 7.0, 7.0]


def test_the_row_masks_are_made_on_the_row_maps_device() -> None:
    """On the meta device (a stand-in for a GPU): a rank-column tensor made on the host fails."""
    from server.engine.weights import Linear

    meta = torch.device("meta")
    deltas = {(0, 0, "o"): [LowRank(a=torch.ones(2, 4, device=meta), b=torch.ones(4, 2, device=meta))]}
    proj = RowDeltaProjection(torch.tensor([0, -1, 0]), deltas, meta)
    out = proj(torch.ones(3, 4, device=meta), Linear(torch.ones(4, 4, device=meta)), layer=0, name="o")
    assert out.device == meta and out.shape == (3, 4)


def test_a_steps_modules_are_its_rows_modules_once_each_in_ascending_order() -> None:
    from server.engine.projection import modules_of

    assert modules_of(torch.tensor([2, -1, 0, 2, 1])) == (0, 1, 2)
    assert modules_of(torch.tensor([-1, -1])) == ()
