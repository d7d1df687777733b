"""agentshare finetune on a tiny random model: loss goes down, module + manifest load, resume, refusals."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from server.cli import app
from server.engine.modules import load_module
from server.engine.weights import ModelShape
from server.kv.family import family_digest
from server.modules.manifest import Manifest, ModuleKind
from server.prompt import Placement
from server.training import split as split_mod
from server.training.dataset import write_jsonl
from server.training.tasks import Difficulty, generate
from server.training.trainer import FamilyMismatch, FinetuneConfig, finetune

SMALL = Difficulty(records=3, chains=1, chain_length=2, tools=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(generate("retrieval", 16, difficulty=SMALL), tmp_path_factory.mktemp("d") / "d.jsonl")


def cfg(tiny_model_dir, data, out, **kw):
    base = dict(base=tiny_model_dir, data=data, output=out, name="agent", rank=4, alpha=8,
                target_modules=("q_proj", "v_proj"), batch_size=4, lr=1e-2, kv_dtype="float32",
                progress=False, checkpoint_every=0)
    return FinetuneConfig(**{**base, **kw})


def test_a_few_steps_reduce_the_loss_and_write_a_servable_module(tiny_model_dir, data, tmp_path):
    res = finetune(cfg(tiny_model_dir, data, tmp_path / "m", epochs=2))
    assert res.steps == 8
    assert sum(res.losses[-2:]) / 2 < res.losses[0] - 0.5
    man = Manifest.read(tmp_path / "m")
    assert man.family == family_digest(tiny_model_dir, kv_dtype="float32") == res.family
    assert man.kind is ModuleKind.LORA and man.invocation is Placement.TURN
    assert man.lora.rank == 4 and man.training["steps"] == 8
    assert not (tmp_path / "m" / "checkpoint").exists()
    from transformers import AutoConfig

    shape = ModelShape.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    mod = load_module(tmp_path / "m", name="agent", family=res.family, base_families={res.family}, shape=shape, dtype=torch.float32)
    assert mod.shares_prefill and mod.placement is Placement.TURN and mod.deltas


def test_resume_from_a_checkpoint_gives_the_same_module(tiny_model_dir, data, tmp_path, monkeypatch):
    straight = finetune(cfg(tiny_model_dir, data, tmp_path / "a", epochs=2))
    calls = {"n": 0}
    real = split_mod.SplitModel.loss

    def crash_after_five(self, batch):
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt
        return real(self, batch)

    monkeypatch.setattr(split_mod.SplitModel, "loss", crash_after_five)
    with pytest.raises(KeyboardInterrupt):
        finetune(cfg(tiny_model_dir, data, tmp_path / "b", epochs=2, checkpoint_every=2))
    progress = json.loads((tmp_path / "b" / "checkpoint" / "progress.json").read_text())
    assert progress["step"] == 4
    monkeypatch.setattr(split_mod.SplitModel, "loss", real)
    resumed = finetune(cfg(tiny_model_dir, data, tmp_path / "b", epochs=2, checkpoint_every=2))
    assert resumed.steps == 8 and resumed.losses[:4] == straight.losses[:4]
    a = load_file(tmp_path / "a" / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "adapter_model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_full_module_and_standard_module(tiny_model_dir, data, tmp_path):
    res = finetune(cfg(tiny_model_dir, data, tmp_path / "full", kind=ModuleKind.FULL, lr=1e-4, epochs=0.25))
    man = Manifest.read(tmp_path / "full")
    assert res.steps == 1 and man.kind is ModuleKind.FULL and man.lora is None
    assert (tmp_path / "full" / "config.json").is_file()
    finetune(cfg(tiny_model_dir, data, tmp_path / "std", cache_conditioned=False, epochs=0.25))
    assert Manifest.read(tmp_path / "std") is None  # never shares the base's prefill
    assert (tmp_path / "std" / "adapter_model.safetensors").is_file()


def test_a_base_of_another_family_is_refused(tiny_model_dir, data, tmp_path):
    with pytest.raises(FamilyMismatch, match="not the requested 000000000000"):
        finetune(cfg(tiny_model_dir, data, tmp_path / "x", family="0" * 64))
    # an output directory holding a module of another family
    Manifest(name="old", kind=ModuleKind.FULL, family="f" * 64).write(tmp_path)
    with pytest.raises(FamilyMismatch, match="already holds a module of family ffffffffffff"):
        finetune(cfg(tiny_model_dir, data, tmp_path))


def test_cli_reports_bad_data_with_its_line(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "c", "instruction": "q", "response": "a"}\n'
                   '{"context": "c", "instruction": "q"}\n')
    r = CliRunner().invoke(app, ["finetune", str(bad), "-o", str(tmp_path / "o"), "--name", "a",
                                 "--base", str(tiny_model_dir), "--kv-dtype", "float32"])
    assert r.exit_code == 2
    assert "bad.jsonl:2: missing field 'response'" in r.output


def test_cli_trains(tiny_model_dir, data, tmp_path):
    r = CliRunner().invoke(app, ["finetune", str(data), "-o", str(tmp_path / "o"), "--name", "a",
                                 "--base", str(tiny_model_dir), "--kv-dtype", "float32", "--rank", "2",
                                 "--target", "q_proj", "--epochs", "0.25", "--placement", "header"])
    assert r.exit_code == 0, r.output
    man = Manifest.read(tmp_path / "o")
    assert man.invocation is Placement.HEADER and man.lora.target_modules == ("q_proj",)


def test_layers_tunes_only_the_top_layers(tiny_model_dir, data, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    n = AutoConfig.from_pretrained(tiny_model_dir).num_hidden_layers
    res = finetune(cfg(tiny_model_dir, data, tmp_path / "top", layers=1, epochs=0.5))
    tensors = load_file(tmp_path / "top" / "adapter_model.safetensors")
    assert tensors and {int(k.split(".layers.")[1].split(".")[0]) for k in tensors} == {n - 1}
    shape = ModelShape.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    mod = load_module(tmp_path / "top", name="agent", family=res.family, base_families={res.family}, shape=shape, dtype=torch.float32)
    assert mod.shares_prefill and {layer for layer, _ in mod.deltas} == {n - 1}
    # a full module: only the top layer's weights (and the final norm) move
    finetune(cfg(tiny_model_dir, data, tmp_path / "full", kind=ModuleKind.FULL, lr=1e-3, layers=1, epochs=0.5))
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "full").state_dict()
    moved = {k.split(".")[2] if ".layers." in k else k for k in before if not torch.equal(before[k], after[k])}
    assert moved == {str(n - 1), "model.norm.weight"}, moved


def test_more_layers_than_the_base_has_is_a_clear_error(tiny_model_dir, data, tmp_path):
    r = CliRunner().invoke(app, ["finetune", str(data), "-o", str(tmp_path / "m"), "--name", "a",
                                 "--base", str(tiny_model_dir), "--layers", "99"])
    assert r.exit_code == 2
    assert "layers=99: the base has 3 layers; tune 1..3 (0: all)" in r.output


def test_recompute_writes_a_manifest_the_engine_serves_as_trained(tiny_model_dir, data, tmp_path, smollm2_tokenizer):
    """``finetune --recompute k``: the manifest says ``recompute_layers: k``; the engine serves the
    module with the layer split, equal to the path it was trained on (SplitModel(recompute=k))."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from server.engine.build import load_engine
    from server.engine.core import EngineConfig
    from server.engine.sampling import SamplingParams
    from server.training.dataset import collate, encode, parse_row, prompt_of

    r = CliRunner().invoke(app, ["finetune", str(data), "-o", str(tmp_path / "m"), "--name", "a",
                                 "--base", str(tiny_model_dir), "--kv-dtype", "float32", "--rank", "4",
                                 "--epochs", "0.5", "--recompute", "2", "--lr", "0.01"])
    assert r.exit_code == 0, r.output
    assert Manifest.read(tmp_path / "m").recompute_layers == 2
    core = load_engine(tiny_model_dir, modules={"a": tmp_path / "m"}, dtype="float32",
                       config=EngineConfig(kv_cache_bytes=32 << 20))
    assert core.modules["a"].recompute_layers == 2 and core.modules["a"].shares_prefill
    module = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                       tmp_path / "m").eval()
    for i, ex in enumerate(parse_row(r) for r in generate("retrieval", 2, seed=7, difficulty=SMALL)):
        batch = collate(encode([ex], smollm2_tokenizer, with_response=False), 0)
        want = split_mod.SplitModel(module, recompute=2).generate(batch, max_new_tokens=6, eos_id=-1)[0]
        core.add_request(f"r{i}", "a", prompt_of(smollm2_tokenizer, ex),
                         SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        got = []
        while core.has_work:
            got += [e.token_id for e in core.step() if e.token_id is not None]
        assert got == want


def test_recompute_needs_a_lora_module_and_at_most_every_layer(tiny_model_dir, data, tmp_path):
    r = CliRunner().invoke(app, ["finetune", str(data), "-o", str(tmp_path / "m"), "--name", "a",
                                 "--base", str(tiny_model_dir), "--recompute", "4"])
    assert r.exit_code == 2 and "recompute=4: the base has 3 layers; recompute 0..3" in r.output
    r = CliRunner().invoke(app, ["finetune", str(data), "-o", str(tmp_path / "m"), "--name", "a",
                                 "--base", str(tiny_model_dir), "--recompute", "1", "--kind", "full"])
    assert r.exit_code == 2 and "the engine serves the layer split for lora modules" in r.output
