"""Moving a prefix's KV between two engines in this process (no network): what the decode side
serves from imported blocks equals what it computes itself, and a failed import is recomputed."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from server.cluster.codec import Codec, decode, encode
from server.cluster.handoff import Inbound, Outbound, gather
from server.engine.build import load_engine
from server.engine.core import EngineConfig, EngineCore
from server.engine.errors import InvalidRequest
from server.engine.sampling import SamplingParams
from server.prompt import Placement, chat_prompt

CONTEXT = [{"role": "user", "content": "Shared notes: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(30))}]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path, make_lora) -> EngineCore:
    return load_engine(tiny_model_dir, modules={"coder": make_lora("coder", 1)}, dtype="float32")


def fresh(loaded: EngineCore, **cfg) -> EngineCore:
    return loaded.with_config(EngineConfig(**{"kv_cache_bytes": 16 << 20, "max_step_tokens": 64, **cfg}))


def drain(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for _ in range(10_000):
        if not core.has_work:
            return out
        for e in core.step():
            if e.token_id is not None:
                out[e.request_id].append(e.token_id)
    raise AssertionError("the engine did not finish")


def prompt_and_prefix(tok, block_size: int = 16):
    p = chat_prompt(tok, CONTEXT, [{"role": "user", "content": "What is item 4?"}])
    ip = p.invocation_point(Placement.TURN)
    return p, list(p.token_ids[: ip // block_size * block_size])


def export_all(prefill: EngineCore, prefix: list[int], first_block: int = 0, chunk_blocks: int = 2) -> list:
    """Run an Outbound to completion on ``prefill``; the chunks it queued, in order."""
    loop = asyncio.new_event_loop()
    try:
        out = Outbound.start(prefill, "t1", prefix, salt="", first_block=first_block, chunk_blocks=chunk_blocks,
                             ttl=60, loop=loop)
        while not out.done:
            prefill.step()
            out.on_step(prefill)
        loop.run_until_complete(asyncio.sleep(0))  # deliver call_soon_threadsafe puts
        items = []
        while not out.queue.empty():
            items.append(out.queue.get_nowait())
        prefill.release_context("t1")
        return items, out
    finally:
        loop.close()


def test_imported_blocks_serve_the_request_exactly_as_a_local_prefill(loaded, smollm2_tokenizer):
    prompt, prefix = prompt_and_prefix(smollm2_tokenizer)
    assert len(prefix) >= 64
    local = fresh(loaded)
    local.add_request("r", "coder", prompt, GREEDY)
    expected = drain(local)["r"]

    prefill, dec = fresh(loaded), fresh(loaded)
    items, out = export_all(prefill, prefix)
    assert items[-1] is None and all(c is not None for c in items[:-1])
    assert len(items) - 1 == -(-len(prefix) // 32)  # chunks of 2 blocks
    assert out.computed_tokens == len(prefix) and prefill.stats.prefill_tokens == len(prefix)

    inbound = Inbound.expect(dec, "t1", prefix, salt="", prefix_codec=None, ttl=60)
    assert (inbound.first_block, inbound.num_blocks) == (0, len(prefix) // 16)
    dec.add_request("r", "coder", prompt, GREEDY)
    dec.step()  # admitted: it waits on the expected blocks, computes nothing
    assert dec.stats.prefill_tokens == 0
    for chunk in items[:-1]:  # through the wire format, as a transport would carry it
        inbound.write(dec, decode(encode(chunk, Codec.FP32, block_size=16), dtype=dec.kv.spec.dtype))
    inbound.finish(dec)
    assert drain(dec)["r"] == expected
    assert dec.stats.prefill_tokens == len(prompt.token_ids) - len(prefix)  # the suffix only


def test_a_transfer_that_fails_midway_is_finished_by_a_local_prefill(loaded, smollm2_tokenizer):
    prompt, prefix = prompt_and_prefix(smollm2_tokenizer)
    local = fresh(loaded)
    local.add_request("r", "coder", prompt, GREEDY)
    expected = drain(local)["r"]

    prefill, dec = fresh(loaded), fresh(loaded)
    items, _ = export_all(prefill, prefix)
    inbound = Inbound.expect(dec, "t1", prefix, salt="", prefix_codec=None, ttl=60)
    dec.add_request("r", "coder", prompt, GREEDY)
    dec.step()
    inbound.write(dec, items[0])  # one chunk arrives, then the prefill worker dies
    inbound.fail(dec)
    assert drain(dec)["r"] == expected
    assert dec.stats.replans == 1
    assert dec.stats.prefill_tokens == len(prompt.token_ids) - 32  # everything but the 2 blocks received


def test_an_unwritten_block_is_never_served(loaded, smollm2_tokenizer):
    _, prefix = prompt_and_prefix(smollm2_tokenizer)
    dec = fresh(loaded)
    inbound = Inbound.expect(dec, "t1", prefix, salt="", prefix_codec=None, ttl=60)
    layout = dec.prefix_layout()
    assert len(dec.pool.match(prefix, layout).pending) == inbound.num_blocks  # matchable, but must be awaited
    inbound.fail(dec)
    assert dec.pool.match(prefix, layout).num_cached_tokens == 0
    assert dec.pool.usage().held == 0


def test_lossy_blocks_live_in_their_own_namespace(loaded, smollm2_tokenizer):
    prompt, prefix = prompt_and_prefix(smollm2_tokenizer)
    prefill, dec = fresh(loaded), fresh(loaded)
    items, _ = export_all(prefill, prefix)
    inbound = Inbound.expect(dec, "t1", prefix, salt="", prefix_codec="int8", ttl=60)
    for chunk in items[:-1]:
        inbound.write(dec, decode(encode(chunk, Codec.INT8, block_size=16), dtype=dec.kv.spec.dtype))
    inbound.finish(dec)
    assert dec.explain("coder", prompt, prefix_codec="int8").num_cached_tokens == len(prefix)
    assert dec.explain("coder", prompt).num_cached_tokens == 0  # never served as exact
    assert dec.explain("coder", prompt, salt="tenant-b", prefix_codec="int8").num_cached_tokens == 0
    dec.add_request("r", "coder", prompt, GREEDY, prefix_codec="int8")
    assert len(drain(dec)["r"]) == 8
    assert dec.stats.prefill_tokens == len(prompt.token_ids) - len(prefix)


def test_only_what_the_decode_side_lacks_is_expected(loaded, smollm2_tokenizer):
    prompt, prefix = prompt_and_prefix(smollm2_tokenizer)
    dec = fresh(loaded)
    dec.add_context("ctx", prefix[:32], ttl=60)
    drain(dec)
    inbound = Inbound.expect(dec, "t1", prefix, salt="", prefix_codec=None, ttl=60)
    assert inbound.first_block == 2 and inbound.num_blocks == len(prefix) // 16 - 2
    prefill = fresh(loaded)
    items, _out = export_all(prefill, prefix, first_block=2)
    assert items[0].first_block == 2
    for chunk in items[:-1]:
        inbound.write(dec, chunk)
    assert inbound.complete
    inbound.finish(dec)
    assert dec.explain("coder", prompt).num_cached_tokens == len(prefix)


def test_chunks_out_of_order_or_of_the_wrong_shape_are_refused(loaded, smollm2_tokenizer):
    _, prefix = prompt_and_prefix(smollm2_tokenizer)
    prefill, dec = fresh(loaded), fresh(loaded)
    items, _ = export_all(prefill, prefix)
    inbound = Inbound.expect(dec, "t1", prefix, salt="", prefix_codec=None, ttl=60)
    with pytest.raises(InvalidRequest, match="expected block 0"):
        inbound.write(dec, items[1])
    wrong = gather(prefill, [0, 1], 0)
    bad = type(wrong)(0, wrong.k[:1], wrong.v[:1])
    with pytest.raises(InvalidRequest, match="KV shape"):
        inbound.write(dec, bad)
    with pytest.raises(InvalidRequest, match="whole blocks"):
        Inbound.expect(dec, "t2", prefix[:20], salt="", prefix_codec=None, ttl=60)
    inbound.fail(dec)


def test_two_exports_of_one_prefix_compute_it_once_and_ship_only_written_blocks(loaded, smollm2_tokenizer):
    """The second export waits on the first's blocks in flight: it must not ship them before
    they are written (they would be zeros), and the prefix is computed once."""
    _, prefix = prompt_and_prefix(smollm2_tokenizer)
    prefill = fresh(loaded)
    loop = asyncio.new_event_loop()
    try:
        outs = [Outbound.start(prefill, f"t{i}", prefix, salt="", first_block=0, chunk_blocks=2, ttl=60, loop=loop)
                for i in (1, 2)]
        while not all(o.done for o in outs):
            prefill.step()
            for o in outs:
                o.on_step(prefill)
        loop.run_until_complete(asyncio.sleep(0))
        shipped = []
        for o in outs:
            items = []
            while not o.queue.empty():
                items.append(o.queue.get_nowait())
            shipped.append(items[:-1])
    finally:
        loop.close()
    assert prefill.stats.prefill_tokens == len(prefix)
    reference = fresh(loaded)
    reference.add_context("ref", prefix, ttl=60)
    drain(reference)
    want = gather(reference, list(reference.contexts["ref"].block_ids), 0)
    for chunks in shipped:
        k = torch.cat([c.k for c in chunks], dim=2)
        assert torch.equal(k, want.k)
