"""Server-wide fixtures: decode modules (LoRA, full, foreign) around the tiny base model."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from server.kv.family import family_digest
from server.modules.manifest import LoraSpec, Manifest, ModuleKind
from server.prompt import Placement

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    mp = pytest.MonkeyPatch()
    mp.setenv("AGENTSHARE_CACHE_DIR", str(tmp_path_factory.mktemp("agentshare-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tiny_family(tiny_model_dir: Path) -> str:
    return family_digest(tiny_model_dir, kv_dtype="float32")


@pytest.fixture(scope="session")
def make_lora(tiny_model_dir: Path, tiny_family: str, tmp_path_factory) -> Callable[..., Path]:
    """``make_lora(name, seed, placement, manifest=True, family=None, recompute_layers=0)``: a
    random (non-zero) peft LoRA adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    made: dict[tuple, Path] = {}

    def make(name: str, seed: int = 1, placement: Placement = Placement.TURN, manifest: bool = True,
             family: str | None = None, recompute_layers: int = 0) -> Path:
        key = (name, seed, placement, manifest, family, recompute_layers)
        if key in made:
            return made[key]
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), init_lora_weights=False)
        model = get_peft_model(base, cfg)
        with torch.no_grad():  # make the adapter matter: B is zero-initialised by peft by default
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.05)
        d = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(d)
        if manifest:
            Manifest(name=name, kind=ModuleKind.LORA, family=family or tiny_family, invocation=placement,
                     lora=LoraSpec(4, 8.0, LORA_TARGETS), recompute_layers=recompute_layers).write(d)
        made[key] = d
        return d

    return make


@pytest.fixture(scope="session")
def make_full(tiny_model_dir: Path, tiny_family: str, tmp_path_factory, make_tiny_model) -> Callable[..., Path]:
    """``make_full(name, seed, manifest=True, foreign=False)``: a perturbed copy of the base (a
    full fine-tune), or with ``foreign`` another random base of the same shapes."""
    from transformers import AutoModelForCausalLM

    def make(name: str, seed: int = 2, manifest: bool = True, foreign: bool = False,
             placement: Placement = Placement.TURN) -> Path:
        if foreign:
            d = make_tiny_model(f"foreign-{name}", seed=seed + 100)
            return d
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        d = tmp_path_factory.mktemp(f"full-{name}")
        model.save_pretrained(d)
        for f in tiny_model_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, d / f.name)
        if manifest:
            Manifest(name=name, kind=ModuleKind.FULL, family=tiny_family, invocation=placement).write(d)
        return d

    return make


