"""Fixtures of the vllm suite: the default model in fp32, its decode modules, and one real
``agentshare serve --engine vllm`` (every instance eager: they start in about a minute).

The suite runs where vLLM is installed (the ``vllm`` extra); elsewhere the root conftest leaves it
uncollected.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from server.kv.family import family_digest
from server.modules.manifest import LoraSpec, Manifest, ModuleKind
from server.process import die_with_parent, free_port, wait_ready

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEYS = ("tenant-a-key", "tenant-b-key")
FOREIGN_FAMILY = "ab" * 32


@pytest.fixture(scope="session")
def base_dir() -> Path:
    from server.models.loader import default_model_dir

    return default_model_dir(progress=False)


@pytest.fixture(scope="session")
def family(base_dir: Path) -> str:
    return family_digest(base_dir, kv_dtype="float32")


def _lora(base_dir: Path, out: Path, seed: int, family: str | None) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), init_lora_weights=False))
    with torch.no_grad():  # strong enough that a private prefill changes the output
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    if family is not None:
        Manifest(name=out.name, kind=ModuleKind.LORA, family=family, lora=LoraSpec(4, 8.0, LORA_TARGETS)).write(out)
    return out


def _full(base_dir: Path, out: Path, seed: int, family: str) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.005)
    model.save_pretrained(out)
    for f in base_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    Manifest(name=out.name, kind=ModuleKind.FULL, family=family).write(out)
    return out


@pytest.fixture(scope="session")
def modules(base_dir: Path, family: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """coder and planner (LoRA, joining the family), foreign (coder's weights, another family's
    manifest) and writer (a full module of the family)."""
    root = tmp_path_factory.mktemp("vllm-modules")
    return {
        "coder": _lora(base_dir, root / "coder", 1, family),
        "planner": _lora(base_dir, root / "planner", 2, family),
        "foreign": _lora(base_dir, root / "foreign", 1, FOREIGN_FAMILY),
        "writer": _full(base_dir, root / "writer", 3, family),
    }


@dataclass
class VllmServer:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def events(self, name: str) -> list[dict]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == name:
                out.append(rec)
        return out

    def instance_url(self, name: str) -> str:
        return f"http://127.0.0.1:{[e for e in self.events('vllm_start') if e['instance'] == name][-1]['port']}"

    def instance_pid(self, name: str) -> int:
        return int([e for e in self.events("vllm_start") if e["instance"] == name][-1]["pid"])

    def metric(self, name: str, *labels: str) -> float:
        """The sum of the samples of ``name`` whose labels hold every ``labels`` text."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and all(t in line for t in labels))

    def store_counter(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith(f'agentshare_vllm_store{{counter="{name}"}}'):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no store counter {name}")


@pytest.fixture(scope="session")
def vllm_server(base_dir: Path, modules: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    args = [sys.executable, "-m", "server.cli", "serve", "--engine", "vllm", "--enforce-eager", "--dtype", "float32",
            "--model", str(base_dir), "--port", str(port), "--kv-cache", "512MiB", "--kv-store", "1GiB",
            *(a for name, path in modules.items() for a in ("--module", f"{name}={path}"))]
    env = {**os.environ, "AGENTSHARE_API_KEYS": " ".join(KEYS), "VLLM_CACHE_ROOT": str(log.parent / "vllm-cache")}
    with open(log, "wb") as out:
        # its own session (stopped as a group), and dies with this process however it ends
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url + "/health", deadline=time.monotonic() + 480, what="agentshare serve --engine vllm",
                   hint=f"; see {log}", poll=1.0)
        yield VllmServer(url, proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
