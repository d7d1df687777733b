"""finetune-joint on a tiny random model: a shared prefill adapter trained jointly with per-task
decode adapters, merged into a new base of a new family, on which decode modules then train and
are served with a shared prefill."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from server.cli import app
from server.engine.build import load_engine
from server.engine.core import EngineConfig
from server.kv.family import family_digest
from server.models.patch import read_patch, resolve_model_dir
from server.modules.manifest import Manifest
from server.modules.registry import ModuleLoadError
from server.training.dataset import DataError, write_jsonl
from server.training.joint import PATCH_DIR, JointConfig, _order, train_joint
from server.training.tasks import Difficulty, generate
from server.training.trainer import BadOption, FinetuneConfig, finetune

SMALL = Difficulty(records=3, chains=1, chain_length=2, tools=1)


def mixture(path, n=8):
    rows = [r for t in ("retrieval", "planning", "tool") for r in generate(t, n, difficulty=SMALL)]
    return write_jsonl(rows, path)


def test_the_joint_base_is_a_new_family_whose_prefill_learned(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSHARE_CACHE_DIR", str(tmp_path / "cache"))
    from transformers import AutoModelForCausalLM

    data = mixture(tmp_path / "mix.jsonl")
    res = train_joint(JointConfig(base=tiny_model_dir, data=data, output=tmp_path / "joint", rank=4, alpha=8,
                                  decode_rank=4, batch_size=4, lr=1e-2, epochs=2, kv_dtype="float32",
                                  progress=False))
    assert res.tasks == ("planning", "retrieval", "tool") and res.steps == 12  # 2 epochs of 3 x 8 rows, 4 a batch
    assert sum(res.losses[-3:]) < sum(res.losses[:3])
    old = family_digest(tiny_model_dir, kv_dtype="float32")
    assert res.family == family_digest(tmp_path / "joint", kv_dtype="float32") != old
    record = json.loads((tmp_path / "joint" / "agentshare-joint.json").read_text())
    assert record["from_family"] == old and record["steps"] == 12
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "joint").state_dict()
    assert set(before) == set(after)  # a plain model: the adapter merged, no peft left
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all("proj" in k for k in moved)  # only the adapted projections changed
    # its patch (the prefill adapter in bf16) rebuilds the same base: what ships instead of the weights
    assert record["patch"] == PATCH_DIR and read_patch(tmp_path / "joint" / PATCH_DIR)["record"]["steps"] == 12
    rebuilt = resolve_model_dir(tmp_path / "joint" / PATCH_DIR)
    assert family_digest(rebuilt, kv_dtype="float32") == res.family
    patch_bytes = sum(f.stat().st_size for f in (tmp_path / "joint" / PATCH_DIR).iterdir())
    assert patch_bytes < (tmp_path / "joint" / "model.safetensors").stat().st_size / 4
    # a decode module trained on the joint base (named by its patch) joins its family and is
    # served from its prefill
    mod = finetune(FinetuneConfig(base=tmp_path / "joint" / PATCH_DIR, data=data, output=tmp_path / "coder", name="coder",
                                  rank=4, alpha=8, target_modules=("q_proj", "v_proj"), batch_size=4, lr=1e-2,
                                  kv_dtype="float32", progress=False, checkpoint_every=0, epochs=0.25))
    assert Manifest.read(tmp_path / "coder").family == res.family == mod.family
    assert Manifest.read(tmp_path / "coder").training["base"] == str((tmp_path / "joint" / PATCH_DIR).resolve())
    core = load_engine(tmp_path / "joint", modules={"coder": tmp_path / "coder"}, dtype="float32", config=EngineConfig(kv_cache_bytes=32 << 20))
    assert core.modules["coder"].shares_prefill
    # on the old base its updates would land on weights they were not trained for: refused
    patch = (tmp_path / "joint" / PATCH_DIR).resolve()
    with pytest.raises(ModuleLoadError, match=re.escape(f"another base model (trained on {patch})")):
        load_engine(tiny_model_dir, modules={"coder": tmp_path / "coder"}, dtype="float32",
                    config=EngineConfig(kv_cache_bytes=32 << 20))


def test_an_interrupted_joint_run_resumes_from_its_checkpoint_to_the_same_patch(tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    from safetensors.torch import load_file

    from server.training import joint as joint_mod

    monkeypatch.setenv("AGENTSHARE_CACHE_DIR", str(tmp_path / "cache"))
    data = mixture(tmp_path / "mix.jsonl", n=4)
    cfg = dict(base=tiny_model_dir, data=data, rank=4, alpha=8, decode_rank=4, batch_size=2, lr=1e-2,
               kv_dtype="float32", progress=False, checkpoint_every=2)
    straight = train_joint(JointConfig(output=tmp_path / "a", **cfg))
    real, calls = joint_mod._loss, {"n": 0}

    def crash_after_three(model, task, batch):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real(model, task, batch)

    monkeypatch.setattr(joint_mod, "_loss", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        train_joint(JointConfig(output=tmp_path / "b", **cfg))
    assert json.loads((tmp_path / "b" / "checkpoint" / "progress.json").read_text())["step"] == 2
    monkeypatch.setattr(joint_mod, "_loss", real)
    with pytest.raises(DataError, match="checkpoint of a different run"):
        train_joint(JointConfig(output=tmp_path / "b", **{**cfg, "lr": 2e-2}))
    resumed = train_joint(JointConfig(output=tmp_path / "b", **cfg))
    assert resumed.steps == straight.steps == 6 and resumed.losses[:2] == straight.losses[:2]
    assert json.loads((tmp_path / "b" / "agentshare-joint.json").read_text())["resumed_at_step"] == 2
    assert not (tmp_path / "b" / "checkpoint").exists()
    a = load_file(tmp_path / "a" / PATCH_DIR / "adapter.safetensors")
    b = load_file(tmp_path / "b" / PATCH_DIR / "adapter.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)  # bf16 patch: equal after rounding


def test_batches_hold_one_task_each_and_every_row_once_an_epoch():
    by_task = {"a": list(range(0, 10)), "b": list(range(10, 13))}
    order = _order(by_task, JointConfig(base="m", data="d", output="o", batch_size=4, epochs=1))
    assert sorted(i for _, b in order for i in b) == list(range(13))
    assert all(all(i in by_task[t] for i in b) for t, b in order)
    assert len(order) == 4  # 3 batches of a, 1 of b


def test_the_command_needs_every_row_to_name_its_task(tiny_model_dir, tmp_path):
    rows = generate("retrieval", 2, difficulty=SMALL)
    rows[1].pop("task")
    data = write_jsonl(rows, tmp_path / "d.jsonl")
    r = CliRunner().invoke(app, ["finetune-joint", str(data), "-o", str(tmp_path / "j"), "--base", str(tiny_model_dir)])
    assert r.exit_code == 2 and "d.jsonl:2" in r.output and "'task'" in r.output


def test_a_scale_that_cannot_merge_exactly_is_refused_before_training(tiny_model_dir, tmp_path):
    data = mixture(tmp_path / "mix.jsonl", n=2)
    with pytest.raises(BadOption, match="power of two"):
        train_joint(JointConfig(base=tiny_model_dir, data=data, output=tmp_path / "j", rank=4, alpha=6, progress=False))
    assert not (tmp_path / "j").exists()
