import json

import pytest

from server.modules.manifest import LoraSpec, Manifest, ManifestError, ModuleKind
from server.prompt import Placement

FAM = "0123456789abcdef" * 4


def lora_manifest(**kw):
    base = dict(name="coder", kind=ModuleKind.LORA, family=FAM, invocation=Placement.HEADER,
                lora=LoraSpec(8, 16.0, ("q_proj", "v_proj")), training={"steps": 10})
    return Manifest(**{**base, **kw})


def test_round_trip_through_a_directory(tmp_path):
    m = lora_manifest()
    m.write(tmp_path)
    got = Manifest.read(tmp_path)
    assert got == m and got.training == {"steps": 10} and got.lora.scale == 2.0


def test_a_directory_without_manifest_has_none(tmp_path):
    assert Manifest.read(tmp_path) is None


def test_invocation_defaults_to_turn():
    d = json.loads(lora_manifest().to_json())
    del d["invocation"]
    assert Manifest.from_json(json.dumps(d)).invocation is Placement.TURN


@pytest.mark.parametrize(
    "mutate, msg",
    [
        (lambda d: d.pop("family"), "missing field 'family'"),
        (lambda d: d.update(family="not-a-digest"), "64-hex-digit"),
        (lambda d: d.update(kind="adapter"), "adapter"),
        (lambda d: d.update(invocation="middle"), "middle"),
        (lambda d: d.update(format=99), "unsupported format"),
        (lambda d: d.pop("lora"), "needs a 'lora' section"),
        (lambda d: d["lora"].update(rank=0), "rank must be positive"),
        (lambda d: d.update(name="a b"), "name must be"),
        (lambda d: d.update(recompute_layers=-1), "recompute_layers must be a whole number >= 0"),
        (lambda d: d.update(recompute_layers=2.5), "recompute_layers must be a whole number"),
        (lambda d: d.update(recompute_layers=True), "recompute_layers must be a whole number"),
    ],
)
def test_bad_manifests_name_the_problem(tmp_path, mutate, msg):
    d = json.loads(lora_manifest().to_json())
    mutate(d)
    (tmp_path / "agentshare-module.json").write_text(json.dumps(d))
    with pytest.raises(ManifestError, match=msg) as err:
        Manifest.read(tmp_path)
    assert "agentshare-module.json" in str(err.value)


def test_invalid_json_is_a_manifest_error(tmp_path):
    (tmp_path / "agentshare-module.json").write_text("{oops")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.read(tmp_path)


def test_only_lora_modules_have_a_lora_section():
    with pytest.raises(ManifestError):
        Manifest(name="x", kind=ModuleKind.FULL, family=FAM, lora=LoraSpec(8, 8, ("q_proj",)))


def test_recompute_layers_round_trips_and_is_left_out_at_zero():
    m = lora_manifest(recompute_layers=22)
    assert Manifest.from_json(m.to_json()).recompute_layers == 22
    # 0 writes the manifest exactly as before the field existed: a module's digest does not move
    assert "recompute_layers" not in lora_manifest().to_json()
    assert Manifest.from_json(lora_manifest().to_json()).recompute_layers == 0
