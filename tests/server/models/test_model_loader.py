"""Loading model directories, and the GGUF -> safetensors conversion of the default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from server import paths
from server.kv.family import family_digest
from server.models import loader
from server.models.loader import (
    ModelLoadError,
    convert_gguf,
    default_gguf_path,
    default_model_dir,
    load_model,
)


def test_default_gguf_is_found_without_importing_its_package() -> None:
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTSHARE_CACHE_DIR", str(tmp_path))
    assert paths.cache_dir() == tmp_path
    monkeypatch.delenv("AGENTSHARE_CACHE_DIR")
    assert paths.cache_dir() == Path.home() / ".cache" / "agentshare"


def test_tiny_model_dir_loads_with_the_real_chat_template(tiny_model_dir: Path) -> None:
    m = load_model(tiny_model_dir)
    assert m.config.model_type == "llama" and m.config.vocab_size == 49152
    text = m.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    emb, out = m.model.get_input_embeddings(), m.model.get_output_embeddings()
    assert emb.weight.data_ptr() == out.weight.data_ptr()  # tied


def test_not_a_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path)


def test_an_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", boom)
    target = tmp_path / "models" / "smol"
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(default_gguf_path(), target, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_a_finished_conversion_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(loader, "convert_gguf", lambda gguf, target, progress: calls.append(target) or target)
    first = default_model_dir(root=tmp_path, progress=False)
    assert calls == [first]
    first.mkdir(parents=True)
    (first / "agentshare-conversion.json").write_text("{}")
    assert default_model_dir(root=tmp_path, progress=False) == first and len(calls) == 1


def test_gguf_conversion_of_the_default_model(tmp_path: Path, default_model: Path) -> None:
    """Full conversion (~20 s): safetensors + tokenizer + template; tied; sensible greedy text;
    the same files as the cached conversion every other test serves."""
    path = default_model_dir(root=tmp_path, progress=False)
    files = {p.name for p in path.iterdir()}
    assert files == {p.name for p in default_model.iterdir()}
    assert (path / "config.json").read_text() == (default_model / "config.json").read_text()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert json.loads((path / "agentshare-conversion.json").read_text())["sha256"]
    m = load_model(path)
    cfg = m.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (30, 576, 3)
    assert cfg.tie_word_embeddings
    assert m.model.get_input_embeddings().weight.data_ptr() == m.model.get_output_embeddings().weight.data_ptr()
    ids = m.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = m.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in m.tokenizer.decode(out[0, ids.shape[1]:])


def test_a_conversion_joins_the_shipped_modules_family_whatever_the_environment(tmp_path: Path, default_model: Path) -> None:
    """The family digest covers the converted tokenizer config, where transformers records
    whether it loaded offline. A user's first conversion, without ``HF_HUB_OFFLINE`` (which the
    project's scripts set), must give the family the shipped team's base patch applies to, or the
    patch would be refused (and the shipped modules could not share)."""
    import os
    import subprocess
    import sys

    from server.models.patch import read_patch

    # the shipped modules' base is a patch of the default model: it names the family it applies to
    shipped = read_patch(Path(__file__).resolve().parents[3] / "examples" / "modules" / "team-base")["base_family"]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = ("import sys; from pathlib import Path; from server.models.loader import default_model_dir; "
            "from server.kv.family import family_digest; "
            "print(family_digest(default_model_dir(root=Path(sys.argv[1]), progress=False), kv_dtype='float32'))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.split()[-1] == shipped == family_digest(default_model, kv_dtype="float32")
