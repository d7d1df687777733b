import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import server.kv.family as family
from server.kv.family import family_digest, family_parts

CONFIG = {
    "model_type": "llama",
    "rope_theta": 100000.0,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "_name_or_path": "/somewhere",
    "transformers_version": "5.0.0",
}


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": torch.randn(8, 8, generator=g) for i in range(4)}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    save_file(tensors(), d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return d


def digest(d, tmp_path, dtype="float32"):
    return family_digest(d, kv_dtype=dtype, cache_dir=tmp_path / "cache")


def clone(d, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(d, out)
    return out


def test_digest_is_deterministic_and_ignores_location_and_cosmetic_keys(model_dir, tmp_path):
    other = clone(model_dir, tmp_path, "copy")
    cfg = dict(CONFIG, _name_or_path="/elsewhere", transformers_version="5.9.9")
    (other / "config.json").write_text(json.dumps(cfg, indent=4))
    assert digest(model_dir, tmp_path) == digest(other, tmp_path)


def test_digest_does_not_depend_on_sharding(model_dir, tmp_path):
    sharded = clone(model_dir, tmp_path, "sharded")
    (sharded / "model.safetensors").unlink()
    t = tensors()
    names = sorted(t)
    save_file({n: t[n] for n in names[:2]}, sharded / "model-00001-of-00002.safetensors")
    save_file({n: t[n] for n in names[2:]}, sharded / "model-00002-of-00002.safetensors")
    assert digest(model_dir, tmp_path) == digest(sharded, tmp_path)


@pytest.mark.parametrize(
    "change",
    ["one weight", "weight dtype", "chat template", "rope theta", "sliding window", "tokenizer"],
)
def test_any_change_that_alters_kv_changes_the_family(model_dir, tmp_path, change):
    other = clone(model_dir, tmp_path, "other")
    t = tensors()
    if change == "one weight":
        t["layer2.w"][3, 4] += 1e-6
        save_file(t, other / "model.safetensors")
    elif change == "weight dtype":
        save_file({k: v.to(torch.bfloat16) for k, v in t.items()}, other / "model.safetensors")
    elif change == "chat template":
        (other / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ m }}"}))
    elif change == "rope theta":
        (other / "config.json").write_text(json.dumps(dict(CONFIG, rope_theta=10000.0)))
    elif change == "sliding window":
        (other / "config.json").write_text(json.dumps(dict(CONFIG, sliding_window=4096)))
    elif change == "tokenizer":
        (other / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    a = family_parts(model_dir, kv_dtype="float32", cache_dir=tmp_path / "cache")
    b = family_parts(other, kv_dtype="float32", cache_dir=tmp_path / "cache")
    assert a.digest != b.digest
    expected = {"one weight": "weights", "weight dtype": "weights", "chat template": "tokenizer",
                "tokenizer": "tokenizer", "rope theta": "config", "sliding window": "config"}
    assert a.differences(b) == [expected[change]]


def test_kv_dtype_and_layout_are_part_of_the_family(model_dir, tmp_path):
    assert digest(model_dir, tmp_path, "float32") != digest(model_dir, tmp_path, "bfloat16")
    a = family_digest(model_dir, kv_dtype="float32", kv_layout="x", cache_dir=tmp_path / "c")
    assert a != digest(model_dir, tmp_path)


def test_weights_are_hashed_once_then_read_from_the_cache(model_dir, tmp_path, monkeypatch):
    calls = []
    real = family._shard_tensor_digests
    monkeypatch.setattr(family, "_shard_tensor_digests", lambda p: calls.append(p) or real(p))
    first = digest(model_dir, tmp_path)
    assert digest(model_dir, tmp_path) == first and len(calls) == 1
    # rewriting the file (new mtime/size) invalidates the entry
    t = tensors()
    t["layer0.w"][0, 0] = 42.0
    save_file(t, model_dir / "model.safetensors")
    assert digest(model_dir, tmp_path) != first and len(calls) == 2


def test_a_corrupt_cache_is_recomputed(model_dir, tmp_path):
    first = digest(model_dir, tmp_path)
    (tmp_path / "cache" / "digests.json").write_text("{not json")
    assert digest(model_dir, tmp_path) == first


@pytest.mark.parametrize("missing", ["model.safetensors", "config.json", "tokenizer"])
def test_incomplete_model_directories_are_refused_clearly(model_dir, tmp_path, missing):
    if missing == "tokenizer":
        (model_dir / "tokenizer.json").unlink()
        (model_dir / "tokenizer_config.json").unlink()
    else:
        (model_dir / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing.split(".")[0]):
        digest(model_dir, tmp_path)


def test_a_non_safetensors_file_is_refused(model_dir, tmp_path):
    (model_dir / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match="not a safetensors file"):
        digest(model_dir, tmp_path)
