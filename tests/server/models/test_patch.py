"""Base patches: a low-rank change to a base, merged the same bits on every build, checked
against the families it records, and accepted wherever a model directory is."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from server.engine.build import load_engine
from server.engine.core import EngineConfig
from server.kv.family import family_digest
from server.models.loader import ModelLoadError
from server.models.patch import (
    ADAPTER_FILE,
    PATCH_FILE,
    apply_patch,
    merge,
    read_patch,
    resolve_model_dir,
    save_patch,
)

UP, Q = "model.layers.0.mlp.up_proj", "model.layers.1.self_attn.q_proj"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSHARE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def adapter(model_dir, seed=0, rank=4):
    w = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in (UP, Q):
        o, i = w[f"{name}.weight"].shape
        out[name] = (torch.randn(rank, i, generator=g) * 0.05, torch.randn(o, rank, generator=g) * 0.05)
    return out


def test_a_patch_rebuilds_the_same_base_bit_for_bit(tiny_model_dir, tmp_path, cache):
    ad = adapter(tiny_model_dir)
    p = save_patch(ad, tmp_path / "p", base=tiny_model_dir, scale=2.0, record={"steps": 3})
    meta = read_patch(p)
    assert meta["base_family"] == family_digest(tiny_model_dir, kv_dtype="float32")
    assert meta["rank"] == 4 and meta["targets"] == ["q_proj", "up_proj"] and meta["record"] == {"steps": 3}
    stored = load_file(p / ADAPTER_FILE)
    assert all(t.dtype == torch.bfloat16 for t in stored.values()) and len(stored) == 4

    one, two = apply_patch(p, tmp_path / "one", base=tiny_model_dir), resolve_model_dir(p)
    assert two.parent == cache / "models" and resolve_model_dir(p) == two  # built once, then found
    a, b, base = load_file(one / "model.safetensors"), load_file(two / "model.safetensors"), load_file(
        tiny_model_dir / "model.safetensors")
    assert set(a) == set(b) == set(base) and all(torch.equal(a[k], b[k]) for k in a)
    changed = {k for k in base if not torch.equal(base[k], a[k])}
    assert changed == {f"{UP}.weight", f"{Q}.weight"}
    # the merge is W + scale * B A of the stored (bf16) factors, rounded once
    A, B = stored[f"{UP}.lora_A"].double(), stored[f"{UP}.lora_B"].double()
    want = (base[f"{UP}.weight"].double() + 2.0 * (B @ A)).float()
    assert torch.equal(a[f"{UP}.weight"], want)
    assert family_digest(two, kv_dtype="float32") == meta["family"] != meta["base_family"]
    assert (two / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()


def test_the_merge_does_not_depend_on_how_the_rank_is_split():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=g)
    a, b = torch.randn(16, 32, generator=g).bfloat16(), torch.randn(64, 16, generator=g).bfloat16()
    full = merge(w, a, b, 2.0)
    assert full.dtype == torch.float32
    # rank-one terms are exact in float64: the sum of two halves, merged as one, is the same bits
    halves = (w.double() + 2.0 * (b[:, :8].double() @ a[:8].double()) + 2.0 * (b[:, 8:].double() @ a[8:].double())).float()
    assert torch.equal(full, halves)


def test_a_patch_refuses_another_base_and_a_changed_adapter(tiny_model_dir, make_tiny_model, tmp_path, cache):
    p = save_patch(adapter(tiny_model_dir), tmp_path / "p", base=tiny_model_dir, scale=2.0)
    other = make_tiny_model("llama-seed7", seed=7)
    with pytest.raises(ModelLoadError, match=r"applies to a base of family .* give the base it was trained on"):
        apply_patch(p, tmp_path / "x", base=other)
    tensors = load_file(p / ADAPTER_FILE)
    tensors[f"{UP}.lora_A"] = tensors[f"{UP}.lora_A"] * 2
    save_file(tensors, p / ADAPTER_FILE)
    with pytest.raises(ModelLoadError, match="the patch or its base was changed"):
        resolve_model_dir(p)
    assert not list((cache / "models").glob("patched-*"))  # nothing half-built is left to be found


def test_bad_patches_and_scales_are_refused_with_the_reason(tiny_model_dir, tmp_path, cache):
    with pytest.raises(ValueError, match="power of two"):
        save_patch(adapter(tiny_model_dir), tmp_path / "p", base=tiny_model_dir, scale=1.5)
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / PATCH_FILE).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ModelLoadError, match="format 'something-else'"):
        resolve_model_dir(tmp_path / "q")
    assert resolve_model_dir(tiny_model_dir) == tiny_model_dir  # a model directory is itself
    with pytest.raises(ModelLoadError, match=r"is not a model directory \(no config.json\) nor a base patch"):
        resolve_model_dir(tmp_path / "no-such-model")


def test_the_engine_serves_a_patch_as_its_base(tiny_model_dir, tmp_path, cache):
    p = save_patch(adapter(tiny_model_dir), tmp_path / "p", base=tiny_model_dir, scale=2.0)
    core = load_engine(p, dtype="float32", config=EngineConfig(kv_cache_bytes=16 << 20))
    assert core.family == family_digest(resolve_model_dir(p), kv_dtype="float32")
    assert core.family != family_digest(tiny_model_dir, kv_dtype="float32")


def test_a_patch_on_a_patched_base_builds_the_chain(tiny_model_dir, tmp_path, cache):
    first = save_patch(adapter(tiny_model_dir, seed=0), tmp_path / "first", base=tiny_model_dir, scale=2.0)
    middle = resolve_model_dir(first)
    second = save_patch(adapter(tiny_model_dir, seed=1), tmp_path / "second", base=middle, scale=2.0,
                        base_name=str(first))  # as finetune-joint names a patch it was trained on
    assert read_patch(second)["base"] == str(first)
    built = resolve_model_dir(second)
    assert family_digest(built, kv_dtype="float32") == read_patch(second)["family"]
    assert len({family_digest(d, kv_dtype="float32") for d in (tiny_model_dir, middle, built)}) == 3
