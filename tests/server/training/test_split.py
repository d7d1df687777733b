"""The split forward: base KV before the IP (bitwise), module KV after it, greedy parity."""

import pytest
import torch

from server.prompt import Placement
from server.training.dataset import collate, encode, parse_row
from server.training.evaluate import Arm, answers
from server.training.split import SplitModel
from server.training.tasks import Difficulty, generate

SMALL = Difficulty(records=3, chains=1, chain_length=2, tools=1)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def lora(seed):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                         init_lora_weights=False)  # random, non-zero adapters
        return get_peft_model(base, cfg).eval()

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return base, lora(1), lora(2)


def _rows(n=3):
    rows = [parse_row(r) for r in generate("retrieval", n, difficulty=SMALL)]
    return rows


def _layers(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("placement", list(Placement))
def test_module_weights_never_touch_the_prefix(models, smollm2_tokenizer, placement):
    base, module, _ = models
    items = encode(_rows(), smollm2_tokenizer, placement=placement)
    batch = collate(items, 0)
    P = batch.prefix_len
    before = _layers(SplitModel(module).kv(batch))
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.5)
    after = _layers(SplitModel(module).kv(batch))
    plain = _layers(SplitModel(base).kv(batch))  # the base alone computes the same prefix
    real = batch.attention_mask.bool()
    for (k0, v0), (k1, v1), (kb, vb) in zip(before, after, plain, strict=True):
        assert torch.equal(k0[..., :P, :], k1[..., :P, :]) and torch.equal(v0[..., :P, :], v1[..., :P, :])
        assert torch.equal(k0[..., :P, :], kb[..., :P, :]) and torch.equal(v0[..., :P, :], vb[..., :P, :])
    # positions >= IP are the module's: every real suffix position changed (v of layer 0 too)
    k0, v0 = before[0]
    k1, v1 = after[0]
    for r in range(len(items)):
        cols = [c for c in range(P, real.shape[1]) if real[r, c]]
        diff = (v0[r, :, cols] - v1[r, :, cols]).abs().amax(dim=(0, 2))
        assert bool((diff > 0).all())
    assert not torch.equal(before[-1][0][..., P:, :], after[-1][0][..., P:, :])


def _reference(base, module, ids, ip, eos, max_new):
    """transformers, one request, no padding: base over ids[:ip], the module from that cache."""
    with torch.no_grad():
        past = base(input_ids=torch.tensor([ids[:ip]]), use_cache=True).past_key_values
        out = module(input_ids=torch.tensor([ids[ip:]]), past_key_values=past, use_cache=True)
        toks = []
        for _ in range(max_new):
            nxt = int(out.logits[0, -1].argmax())
            if nxt == eos:
                break
            toks.append(nxt)
            out = module(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return toks


def test_greedy_from_a_shared_prefill_equals_the_reference_path(models, smollm2_tokenizer):
    base, m1, m2 = models
    rows = _rows(4)
    arms = {"a": Arm(SplitModel(m1), shared=True), "b": Arm(SplitModel(m2), shared=True),
            "base": Arm(SplitModel(base), shared=True)}
    got = answers(arms, rows, smollm2_tokenizer, batch_size=3, max_new_tokens=6)
    items = encode(rows, smollm2_tokenizer, with_response=False)
    eos = smollm2_tokenizer.eos_token_id
    for name, module in (("a", m1), ("b", m2), ("base", base)):
        for i, it in enumerate(items):
            want = _reference(base, module, list(it.ids), it.ip, eos, 6)
            assert got[name][i] == smollm2_tokenizer.decode(want, skip_special_tokens=True), (name, i)
    assert got["a"] != got["b"]


def test_own_prefill_differs_from_shared_for_a_lora(models, smollm2_tokenizer):
    _, m1, _ = models
    items = encode(_rows(2), smollm2_tokenizer)
    own = SplitModel(m1).loss(collate(items, 0, split=False))
    shared = SplitModel(m1).loss(collate(items, 0, split=True))
    assert not torch.isclose(own, shared)


def test_partial_recompute_spans_shared_to_private(models, smollm2_tokenizer):
    base, m1, _ = models
    rows = _rows(3)
    items = encode(rows, smollm2_tokenizer, with_response=False)
    own = SplitModel(m1).generate(collate(items, 0, split=False), max_new_tokens=5, eos_id=-1)
    shared = SplitModel(m1).generate(collate(items, 0), max_new_tokens=5, eos_id=-1)
    n = base.config.num_hidden_layers
    for k, want in ((0, shared), (n, own)):
        got = SplitModel(m1, recompute=k).generate(collate(items, 0), max_new_tokens=5, eos_id=-1)
        assert got == want, k
    batch = collate(items, 0)
    full = SplitModel(m1, recompute=1).prefix(batch)
    ref = SplitModel(m1).prefix(batch)
    for i, (a, b) in enumerate(zip(full.layers, ref.layers, strict=True)):
        assert torch.equal(a.values, b.values) == (i < n - 1), i  # v_proj is adapted


def test_the_layer_split_keeps_the_lower_layers_the_base_s_at_every_position(tiny_model_dir, smollm2_tokenizer):
    """LoRA on the top layer only, recomputing that layer's prefix: below the split, every
    position's KV (prefix and suffix) is the base's; at the top layer both differ."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    n = base.config.num_hidden_layers
    torch.manual_seed(3)
    top = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                         LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"], init_lora_weights=False,
                                    layers_to_transform=[n - 1], layers_pattern="layers")).eval()
    batch = collate(encode(_rows(3), smollm2_tokenizer), 0)
    got, want = SplitModel(top, recompute=1).kv(batch), SplitModel(base).kv(batch)
    P = batch.prefix_len
    for i, (a, b) in enumerate(zip(got.layers, want.layers, strict=True)):
        if i < n - 1:
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), i
        else:
            assert not torch.equal(a.keys[:, :, :P], b.keys[:, :, :P])  # the module's own prefix KV
            assert not torch.equal(a.keys[:, :, P:], b.keys[:, :, P:])
