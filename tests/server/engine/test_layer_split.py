"""The layer split in the engine: a LoRA module that recomputes the prefix KV of its top k
layers (``recompute_layers`` in its manifest) against the training-time reference path
(``SplitModel(recompute=k)``), in fp32, on the tiny 3-layer model."""

from __future__ import annotations

import pytest
import torch

from server.engine.sampling import SamplingParams
from server.prompt import chat_prompt
from server.training.dataset import Batch
from server.training.split import SplitModel
from tests.server.engine.test_core import CONTEXT, FORCED, drain, engine, forced, turn

ATOL = 2e-4


def reference(tiny_model_dir, module_dir, k: int, tokens: list[int], ip: int, n_rows: int) -> torch.Tensor:
    """Logits of the last ``n_rows`` positions as fine-tuning computes them: the base over
    ``tokens[:ip]``, the module's top ``k`` layers recomputed over them from the base's hidden
    state, then the module over the rest."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    module = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                       module_dir).eval()
    n = len(tokens)
    batch = Batch(torch.tensor([tokens]), torch.ones(1, n, dtype=torch.long), torch.arange(n)[None],
                  torch.full((1, n - ip), -100), ip)
    split = SplitModel(module, recompute=k)
    with torch.no_grad():
        h = split.suffix_hidden(batch, split.prefix(batch))
        return module.get_base_model().lm_head(h[0, -n_rows:])


@pytest.fixture(scope="module")
def split_dirs(make_lora):
    return {k: make_lora(f"split{k}", seed=5, recompute_layers=k) for k in (1, 2)}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("family_cached", [True, False], ids=["filled", "computed"])
def test_a_split_module_equals_the_training_reference(tiny_model_dir, smollm2_tokenizer, split_dirs, k,
                                                       family_cached):
    core, logits = engine(tiny_model_dir, {"m": split_dirs[k]})
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    ip = prompt.invocation_point(core.modules["m"].placement)
    if family_cached:  # the base prefilled the context: the module fills its prefix from it
        core.add_context("ctx", prompt.token_ids[: prompt.context_len], ttl=60)
        drain(core)
    core.add_request("r", "m", prompt, forced())
    drain(core)
    full = ip // 16 * 16
    assert core.stats.recomputed_prefix_tokens == (full if family_cached else 0)
    assert core.stats.split_saved_layer_rows == (full * (3 - k) if family_cached else 0)
    want = reference(tiny_model_dir, split_dirs[k], k, list(prompt.token_ids) + list(FORCED[:-1]), ip, len(FORCED))
    got = torch.stack(logits["r"])
    assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()
    # and it is not the module at full sharing: the recompute changed the logits
    plain = reference(tiny_model_dir, split_dirs[k], 0, list(prompt.token_ids) + list(FORCED[:-1]), ip, len(FORCED))
    assert (plain - want).abs().max() > 10 * ATOL


def test_a_later_turn_reads_the_recomputed_prefix_again(tiny_model_dir, smollm2_tokenizer, split_dirs):
    core, logits = engine(tiny_model_dir, {"m": split_dirs[1]})
    first = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    core.add_context("ctx", first.token_ids[: first.context_len], ttl=60)
    drain(core)
    core.add_request("t1", "m", first, forced(2))
    drain(core)
    filled = core.stats.recomputed_prefix_tokens
    assert filled > 0
    later = chat_prompt(smollm2_tokenizer, CONTEXT, [*turn("Which item is 5?"),
                                                     {"role": "assistant", "content": "Item 3."},
                                                     *turn("And which is 6?")])
    seq = core.add_request("t2", "m", later, forced())
    drain(core)
    ip = later.invocation_point(core.modules["m"].placement)
    assert seq.cached_tokens == first.invocation_point(core.modules["m"].placement) // 16 * 16  # its own blocks
    # nothing filled again: its earlier blocks hit, and the family's cache holds none of the
    # first turn's (the module computed those), so it computes them itself
    assert core.stats.recomputed_prefix_tokens == filled
    want = reference(tiny_model_dir, split_dirs[1], 1, list(later.token_ids) + list(FORCED[:-1]), ip, len(FORCED))
    assert torch.allclose(torch.stack(logits["t2"]), want, atol=ATOL)


def test_a_split_never_fills_from_another_tenant(tiny_model_dir, smollm2_tokenizer, split_dirs):
    core, _ = engine(tiny_model_dir, {"m": split_dirs[1]})
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    core.add_context("ctx", prompt.token_ids[: prompt.context_len], ttl=60, salt="tenant-a")
    drain(core)
    assert core.explain_split("m", prompt, salt="tenant-b") == (1, 0)
    assert core.explain_split("m", prompt, salt="tenant-a")[1] == prompt.context_len // 16
    seq = core.add_request("b", "m", prompt, forced(2), salt="tenant-b")
    drain(core)
    assert seq.cached_tokens == 0 and core.stats.recomputed_prefix_tokens == 0


def test_imported_family_blocks_are_never_filled_from(tiny_model_dir, smollm2_tokenizer, split_dirs):
    """Blocks that arrived over a link carry no hidden state: the split module computes its
    prefix itself (the imported K/V here is garbage, so reading it would show)."""
    from server.cluster.codec import KVChunk
    from server.cluster.handoff import Inbound

    core, logits = engine(tiny_model_dir, {"m": split_dirs[2]})
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    n = prompt.context_len // 16 * 16
    inbound = Inbound.expect(core, "t", list(prompt.token_ids[:n]), salt="", prefix_codec=None, ttl=60)
    spec = core.kv.spec
    shape = (spec.num_layers, spec.num_kv_heads, n, spec.head_dim)
    inbound.write(core, KVChunk(0, torch.randn(shape), torch.randn(shape)))
    assert core.explain_split("m", prompt) == (2, 0)
    core.add_request("r", "m", prompt, forced())
    drain(core)
    assert core.stats.recomputed_prefix_tokens == 0
    ip = prompt.invocation_point(core.modules["m"].placement)
    want = reference(tiny_model_dir, split_dirs[2], 2, list(prompt.token_ids) + list(FORCED[:-1]), ip, len(FORCED))
    assert torch.allclose(torch.stack(logits["r"]), want, atol=ATOL)


def test_other_modules_are_bitwise_unchanged_beside_a_split_one(tiny_model_dir, smollm2_tokenizer, make_lora,
                                                                 split_dirs):
    """k = 0 stays what it was: the same LoRA request, in an engine that also keeps hidden
    states for a split module (and served it just before), gives the same logits bit for bit."""
    plain = make_lora("plain", seed=3)
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    got = {}
    for modules in ({"plain": plain}, {"plain": plain, "m": split_dirs[1]}):
        core, logits = engine(tiny_model_dir, modules)
        core.add_context("ctx", prompt.token_ids[: prompt.context_len], ttl=60)
        drain(core)
        if "m" in modules:
            core.add_request("s", "m", prompt, forced())
            drain(core)
            assert core.kv.hidden and core.stats.recomputed_prefix_tokens > 0
        core.add_request("r", "plain", prompt, forced())
        drain(core)
        got[len(modules)] = torch.stack(logits["r"])
    assert torch.equal(got[1], got[2])


def test_concurrent_agents_wait_for_the_family_prefill_and_fill_from_it(tiny_model_dir, smollm2_tokenizer,
                                                                       make_lora, split_dirs):
    """A plain agent and a split agent sent together on a cold context: the plain one's request
    computes the family's blocks, the split one waits for them and fills from them."""
    plain = make_lora("plain", seed=3)
    core, logits = engine(tiny_model_dir, {"plain": plain, "m": split_dirs[1]})
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    core.add_request("a", "plain", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    core.add_request("b", "m", prompt, forced())
    drain(core)
    ip = prompt.invocation_point(core.modules["m"].placement)
    assert core.stats.recomputed_prefix_tokens == ip // 16 * 16
    want = reference(tiny_model_dir, split_dirs[1], 1, list(prompt.token_ids) + list(FORCED[:-1]), ip, len(FORCED))
    assert torch.allclose(torch.stack(logits["b"]), want, atol=ATOL)


@pytest.mark.parametrize("step_tokens", [4096, 40], ids=["one-step", "chunked"])
def test_fills_of_two_depths_and_a_plain_agent_run_in_one_forward_per_step(
    tiny_model_dir, smollm2_tokenizer, make_lora, split_dirs, step_tokens
):
    """After the context is pinned, a plain agent and split agents of two depths sent together:
    every step runs one base forward, the filled rows join it at their split and the rest of
    each prompt runs from layer 0 in that same forward, so each agent's first token comes in
    the same step. ``chunked``: steps of 40 tokens cut the fills anywhere, the last chunk of a
    fill running on past its end. Each agent still equals its training-time reference."""
    plain = make_lora("plain", seed=3)
    core, logits = engine(tiny_model_dir, {"plain": plain, "m1": split_dirs[1], "m2": split_dirs[2]},
                          max_step_tokens=step_tokens, max_prefill_step_tokens=step_tokens)
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    core.add_context("ctx", prompt.token_ids[: prompt.context_len], ttl=60)
    drain(core)
    calls: list = []  # each base forward's joins

    class Counting:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def __call__(self, *args, **kwargs):
            calls.append(kwargs.get("joins", ()))
            return self.real(*args, **kwargs)

    core.forward = Counting(core.forward)
    for rid in ("plain", "m1", "m2"):
        core.add_request(rid, rid, prompt, forced())
    first_token_step, step = {}, 0
    while core.has_work:
        step += 1
        before = len(calls)
        for e in core.step():
            if e.token_id is not None:
                first_token_step.setdefault(e.request_id, step)
        assert len(calls) == before + 1  # one forward per step, fills included
    ip = prompt.invocation_point(core.modules["m1"].placement)
    full = ip // 16 * 16
    if step_tokens > 3 * len(prompt.token_ids):  # nobody waits a step for its fill
        assert set(first_token_step.values()) == {1}, first_token_step
    assert {j.layer for joins in calls for j in joins} | {0} >= {1, 2}  # rows joined at the splits
    assert core.stats.recomputed_prefix_tokens == 2 * full
    assert core.stats.split_saved_layer_rows == full * (3 - 1) + full * (3 - 2)
    tokens = list(prompt.token_ids) + list(FORCED[:-1])
    for rid, module_dir, k in (("plain", plain, 0), ("m1", split_dirs[1], 1), ("m2", split_dirs[2], 2)):
        want = reference(tiny_model_dir, module_dir, k, tokens, ip, len(FORCED))
        assert torch.allclose(torch.stack(logits[rid]), want, atol=ATOL), (rid, (torch.stack(logits[rid]) - want).abs().max())


def _export(prefill, prefix: list[int], depths: tuple[int, ...]) -> list:
    """The chunks an Outbound queues for ``prefix`` on ``prefill`` (hidden states of ``depths``)."""
    import asyncio

    from server.cluster.handoff import Outbound

    loop = asyncio.new_event_loop()
    try:
        out = Outbound.start(prefill, "t", prefix, salt="", first_block=0, chunk_blocks=2, ttl=60, loop=loop,
                             hidden_depths=depths)
        while not out.done:
            prefill.step()
            out.on_step(prefill)
        loop.run_until_complete(asyncio.sleep(0))
        items = []
        while not out.queue.empty():
            items.append(out.queue.get_nowait())
        return [c for c in items if c is not None]
    finally:
        loop.close()


def test_blocks_imported_with_their_hidden_state_fill_a_split_request(tiny_model_dir, smollm2_tokenizer, split_dirs):
    """A prefill engine keeps the input of the split layer and sends it with the K/V (through the
    wire format); the decode engine expects the blocks with it, so a split request admitted while
    they travel plans its fill, waits, and then recomputes only its top layers over them: equal
    to the training-time reference."""
    from server.cluster.codec import Codec, decode, encode
    from server.cluster.handoff import Inbound

    prefill, _ = engine(tiny_model_dir, keep_hidden=(1,))
    assert sorted(prefill.kv.hidden) == [1]
    dec, logits = engine(tiny_model_dir, {"m": split_dirs[2]})
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    ip = prompt.invocation_point(dec.modules["m"].placement)
    prefix = list(prompt.token_ids[: ip // 16 * 16])
    chunks = _export(prefill, prefix, (1,))
    assert all(sorted(c.hidden) == [1] for c in chunks)
    inbound = Inbound.expect(dec, "t", prefix, salt="", prefix_codec=None, ttl=60, hidden=True)
    assert dec.explain_split("m", prompt) == (2, len(prefix) // 16)  # fillable while on their way
    dec.add_request("r", "m", prompt, forced())
    dec.step()  # admitted: it waits for the blocks
    assert dec.stats.prefill_tokens == 0
    for chunk in chunks:
        inbound.write(dec, decode(encode(chunk, Codec.FP32, block_size=16), dtype=dec.kv.spec.dtype))
    inbound.finish(dec)
    drain(dec)
    assert dec.stats.recomputed_prefix_tokens == len(prefix)
    assert dec.stats.split_saved_layer_rows == len(prefix) * 1
    want = reference(tiny_model_dir, split_dirs[2], 2, list(prompt.token_ids) + list(FORCED[:-1]), ip, len(FORCED))
    assert torch.allclose(torch.stack(logits["r"]), want, atol=ATOL)


def test_a_chunk_without_the_promised_hidden_state_fails_its_transfer_and_the_request_computes(
    tiny_model_dir, smollm2_tokenizer, split_dirs
):
    from server.cluster.handoff import Inbound
    from server.engine.errors import InvalidRequest

    prefill, _ = engine(tiny_model_dir)  # keeps no hidden state
    dec, logits = engine(tiny_model_dir, {"m": split_dirs[2]})
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    ip = prompt.invocation_point(dec.modules["m"].placement)
    prefix = list(prompt.token_ids[: ip // 16 * 16])
    chunks = _export(prefill, prefix, ())
    with pytest.raises(InvalidRequest, match="no hidden state at layers"):
        _export(prefill, prefix, (1,))
    inbound = Inbound.expect(dec, "t", prefix, salt="", prefix_codec=None, ttl=60, hidden=True)
    dec.add_request("r", "m", prompt, forced())
    dec.step()
    with pytest.raises(InvalidRequest, match=r"hidden state of layers \[1\] was promised"):
        inbound.write(dec, chunks[0])
    inbound.fail(dec)
    drain(dec)
    assert dec.stats.recomputed_prefix_tokens == 0 and dec.stats.replans == 1
    want = reference(tiny_model_dir, split_dirs[2], 2, list(prompt.token_ids) + list(FORCED[:-1]), ip, len(FORCED))
    assert torch.allclose(torch.stack(logits["r"]), want, atol=ATOL)


def test_an_engine_keeps_the_hidden_state_it_is_asked_to_and_refuses_a_layer_it_lacks(tiny_model_dir, split_dirs):
    plain, _ = engine(tiny_model_dir, keep_hidden=(1, 2))
    assert sorted(plain.kv.hidden) == [1, 2]  # a prefill worker's, with no split module of its own
    both, _ = engine(tiny_model_dir, {"m": split_dirs[1]}, keep_hidden=(1,))
    assert sorted(both.kv.hidden) == [1, 2]  # its module's split and the asked one
    for bad in (0, 3):
        with pytest.raises(ValueError, match="hidden depths"):
            engine(tiny_model_dir, keep_hidden=(bad,))
