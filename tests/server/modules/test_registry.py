"""Loading decode modules: who shares, who gets a private prefill, and clear refusals."""

import json

import pytest
import torch

from server.engine.modules import load_module
from server.engine.weights import ModelShape
from server.kv.family import base_families, family_digest
from server.modules.manifest import LoraSpec, Manifest, ModuleKind
from server.modules.registry import ModuleLoadError
from server.prompt import Placement

SHAPE = ModelShape("llama", 49152, 256, 3, 4, 2, 64, 1e-5, 4096)


def load(path, family, base_families=None):
    """Load as a server whose base is ``family`` would (``base_families``: that base's family at
    every KV dtype; by default ``family`` alone)."""
    return load_module(path, name="m", family=family, base_families=base_families or {family},
                       shape=SHAPE, dtype=torch.float32)


def test_a_manifest_naming_the_family_shares(make_lora, tiny_family):
    m = load(make_lora("share", placement=Placement.HEADER), tiny_family)
    assert m.shares_prefill and m.kind == ModuleKind.LORA and m.placement is Placement.HEADER
    assert set(name for _, name in m.deltas) == {"qkv", "o", "gate_up", "down"}
    q, k, v = (next(u for u in m.deltas[(0, "qkv")] if u.col == c) for c in (0, 256, 384))
    assert q.b.shape[0] == 256 and k.b.shape[0] == v.b.shape[0] == 128
    assert m.deltas[(0, "gate_up")][1].col == 512  # up sits after gate (intermediate 512)


def test_no_manifest_or_the_base_at_another_kv_dtype_means_a_private_prefill(make_lora, tiny_family,
                                                                            tiny_model_dir):
    bf16 = family_digest(tiny_model_dir, kv_dtype="bfloat16")  # trained with bf16 KV, served in fp32
    plain = load(make_lora("plain", manifest=False), tiny_family)
    other = load(make_lora("bf16", family=bf16), tiny_family, base_families(tiny_model_dir))
    assert not plain.shares_prefill and "no agentshare-module.json" in plain.reason
    assert not other.shares_prefill
    assert "this base at another KV dtype than the server's" in other.reason and "private prefill" in other.reason
    assert plain.digest != other.digest  # distinct KV namespaces


def test_a_lora_trained_on_another_base_is_refused(make_lora, tiny_family, tiny_model_dir, tmp_path):
    """Its updates would land on weights they were not trained for: refused, naming the base it
    was trained on, rather than served on the wrong weights with a private prefill."""
    import shutil

    alien = shutil.copytree(make_lora("alien", family="e" * 64), tmp_path / "alien")
    m = Manifest.read(alien)
    Manifest(name=m.name, kind=m.kind, family=m.family, lora=m.lora,
             training={"config": {"base": "/models/other-base"}}).write(alien)
    with pytest.raises(ModuleLoadError, match=r"another base model \(trained on /models/other-base\).*"
                                              r"eeeeeeeeeeee….*--model set to the base it was trained on"):
        load(alien, tiny_family, base_families(tiny_model_dir))
    with pytest.raises(ModuleLoadError, match=r"^module 'm': a LoRA adapter for another base model: its manifest "
                                              r"names family eeeeeeeeeeee"):
        load(make_lora("alien", family="e" * 64), tiny_family)  # no training record: no base named
    Manifest(name=m.name, kind=m.kind, family=m.family, lora=m.lora,  # the record's own "base" comes first
             training={"base": "/models/the-patch", "config": {"base": "/cache/patched-1"}}).write(alien)
    with pytest.raises(ModuleLoadError, match=r"another base model \(trained on /models/the-patch\)"):
        load(alien, tiny_family, base_families(tiny_model_dir))


def test_a_full_module_of_another_family_is_served_privately_and_says_so(make_full, tiny_family, tiny_model_dir,
                                                                         tmp_path):
    """A full module is its own model: another family's manifest gets a private prefill, not a refusal."""
    import shutil

    d = shutil.copytree(make_full("other"), tmp_path / "other")
    m = Manifest.read(d)
    Manifest(name=m.name, kind=m.kind, family="e" * 64).write(d)
    found = load(d, tiny_family, base_families(tiny_model_dir))
    assert not found.shares_prefill
    assert found.reason == f"manifest names family {'e' * 12}…, not the server's {tiny_family[:12]}…: private prefill"


def test_a_layer_split_module_is_its_own_module_and_keeps_its_k(make_lora, tiny_family, tiny_model_dir):
    split = load(make_lora("k", recompute_layers=2), tiny_family)
    plain = load(make_lora("k"), tiny_family)
    assert split.recompute_layers == 2 and plain.recompute_layers == 0
    assert split.digest != plain.digest and "recomputes its top 2 layers" in split.reason
    # a private prefill recomputes everything anyway: the split does not apply
    bf16 = family_digest(tiny_model_dir, kv_dtype="bfloat16")
    private = load(make_lora("k", family=bf16, recompute_layers=2), tiny_family, base_families(tiny_model_dir))
    assert private.recompute_layers == 0 and not private.shares_prefill
    with pytest.raises(ModuleLoadError, match="recompute_layers 4 exceeds the base's 3 layers"):
        load(make_lora("k", recompute_layers=4), tiny_family)


def test_a_full_module_with_a_layer_split_is_refused(make_full, tiny_family, tmp_path):
    import dataclasses
    import shutil

    d = shutil.copytree(make_full("fs"), tmp_path / "fs")
    dataclasses.replace(Manifest.read(d), recompute_layers=1).write(d)
    with pytest.raises(ModuleLoadError, match="recompute_layers is served for lora modules only"):
        load(d, tiny_family)


def test_module_digest_follows_the_weights(make_lora, tiny_family):
    a = load(make_lora("d1", seed=1), tiny_family)
    b = load(make_lora("d1", seed=2), tiny_family)
    assert a.digest != b.digest


def test_bad_module_directories_are_refused_clearly(tmp_path, make_lora, tiny_family):
    with pytest.raises(ModuleLoadError, match="not a directory"):
        load(tmp_path / "missing", tiny_family)
    with pytest.raises(ModuleLoadError, match="neither a peft adapter"):
        load(tmp_path, tiny_family)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "agentshare-module.json").write_text("{")
    with pytest.raises(ModuleLoadError, match="not valid JSON"):
        load(broken, tiny_family)
    no_rank = tmp_path / "norank"
    src = make_lora("r0")
    no_rank.mkdir()
    for f in src.iterdir():
        (no_rank / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((no_rank / "adapter_config.json").read_text())
    cfg["r"] = 0
    (no_rank / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModuleLoadError, match="positive 'r'"):
        load(no_rank, tiny_family)


def test_a_full_module_with_another_kv_shape_is_refused(make_tiny_model, tiny_family):
    other = make_tiny_model("wide-kv", num_key_value_heads=4)
    Manifest(name="w", kind=ModuleKind.FULL, family=tiny_family).write(other)
    with pytest.raises(ModuleLoadError, match="KV shape"):
        load(other, tiny_family)


def _fixed_file(path, data: bytes) -> None:
    """``data`` as the file; a ``.safetensors`` file holds it as one uint8 tensor ``w``."""
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({"w": torch.frombuffer(bytearray(data), dtype=torch.uint8)}, str(path))
    else:
        path.write_bytes(data)


def test_a_weights_file_that_is_not_safetensors_is_refused_clearly(tmp_path, tiny_family):
    from server.modules.registry import identify

    d = tmp_path / "truncated"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(b"abc")
    with pytest.raises(ModuleLoadError, match=r"module 'm': its weights cannot be read .*too short.*re-export"):
        identify(d, name="m", family=tiny_family)


def test_without_a_manifest_the_files_say_the_kind(tmp_path, tiny_family):
    from server.modules.registry import identify

    lora = tmp_path / "lora"
    lora.mkdir()
    _fixed_file(lora / "adapter_model.safetensors", b"x")
    assert identify(lora, name="m", family=tiny_family).kind == "lora"
    full = tmp_path / "full"
    full.mkdir()
    _fixed_file(full / "config.json", b"{}")
    _fixed_file(full / "model-00001.safetensors", b"x")
    assert identify(full, name="m", family=tiny_family).kind == "full"
    for files in ({"config.json": b"{}"}, {"model.safetensors": b"x"}, {"adapter_config.json": b"{}"}):
        d = tmp_path / "-".join(files)
        d.mkdir()
        for f, data in files.items():
            _fixed_file(d / f, data)
        with pytest.raises(ModuleLoadError, match="neither a peft adapter"):
            identify(d, name="m", family=tiny_family)


def test_the_module_digest_covers_its_manifest_configs_and_weights_and_keeps_its_format(tmp_path, tiny_family):
    """The digest names the module's KV namespace: every part of the module moves it, and its
    format is pinned (a change would orphan every stored module's blocks)."""
    from server.modules.registry import identify

    def module(name: str, files: dict[str, bytes], manifest: Manifest | None = None) -> str:
        d = tmp_path / name
        d.mkdir()
        for f, data in files.items():
            _fixed_file(d / f, data)
        if manifest is not None:
            manifest.write(d)
        return identify(d, name="m", family=tiny_family).digest

    lora = {"adapter_model.safetensors": b"weights", "adapter_config.json": b'{"r": 4}'}
    plain = module("plain", lora)
    # sha256 of b"agentshare/module/v1\n", b"no-manifest", the adapter config, the weights' digest
    assert plain == "471e2648293cd684f887337cec676564da27edeba74f2a65e6f3016ee4a6ab8e"
    assert module("same", lora) == plain
    assert module("other-config", lora | {"adapter_config.json": b'{"r": 8}'}) != plain
    assert module("other-weights", lora | {"adapter_model.safetensors": b"weightz"}) != plain
    spec = LoraSpec(4, 8.0, ("q_proj",))
    with_manifest = module("manifest", lora, Manifest(name="a", kind=ModuleKind.LORA, family=tiny_family, lora=spec))
    assert with_manifest != plain
    other = Manifest(name="b", kind=ModuleKind.LORA, family=tiny_family, lora=spec)
    assert module("manifest-b", lora, other) != with_manifest
    full = {"config.json": b'{"hidden_size": 8}', "model.safetensors": b"weights"}
    assert module("full", full) != module("full-other-config", full | {"config.json": b'{"hidden_size": 16}'})


def test_a_measured_fidelity_is_carried_only_by_a_module_that_shares(make_lora, tiny_family, tiny_model_dir,
                                                                    tmp_path):
    import dataclasses
    import shutil

    from server.modules.registry import identify

    record = {"metric": "exact", "shared": 0.9, "own": 0.92, "gap_points": 2.0}
    shares = tmp_path / "shares"
    shutil.copytree(make_lora("fid"), shares)
    dataclasses.replace(Manifest.read(shares), fidelity=record).write(shares)
    assert identify(shares, name="m", family=tiny_family).fidelity == record
    assert load(shares, tiny_family).fidelity == record
    bf16 = family_digest(tiny_model_dir, kv_dtype="bfloat16")  # served at another KV dtype: private
    private = tmp_path / "private"
    shutil.copytree(make_lora("fid-bf16", family=bf16), private)
    dataclasses.replace(Manifest.read(private), fidelity=record).write(private)
    assert identify(private, name="m", family=tiny_family).fidelity is None
