"""Fixtures of the vllm suite: the default model in fp32, its decode modules, and one real
``agentshare serve --engine vllm`` (every instance eager: they start in about a minute).

The suite runs where vLLM is installed (the ``vllm`` extra); elsewhere the root conftest leaves it
uncollected.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
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
    """coder and planner (LoRA, joining the family), foreign (coder's weights, its manifest naming
    the base's family at bf16 KV: served with a private prefill in this fp32 server) and writer (a
    full module of the family)."""
    root = tmp_path_factory.mktemp("vllm-modules")
    return {
        "coder": _lora(base_dir, root / "coder", 1, family),
        "planner": _lora(base_dir, root / "planner", 2, family),
        "foreign": _lora(base_dir, root / "foreign", 1, family_digest(base_dir, kv_dtype="bfloat16")),
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


def launch(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``python -m server.cli ARGS`` in a session of its own (stopped as a group), dying with this
    process however it ends, logging to ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "server.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, preexec_fn=die_with_parent)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def serve_vllm(args: list[str], log: Path, *, what: str = "agentshare serve --engine vllm") -> Iterator[VllmServer]:
    """A real ``agentshare serve --engine vllm`` (eager, fp32) with ``args`` added, once it serves."""
    port = free_port()
    env = {**os.environ, "AGENTSHARE_API_KEYS": " ".join(KEYS), "VLLM_CACHE_ROOT": str(log.parent / "vllm-cache")}
    proc = launch(["serve", "--engine", "vllm", "--enforce-eager", "--dtype", "float32", "--port", str(port),
                   "--kv-cache", "512MiB", "--kv-store", "1GiB", *args], log, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url + "/health", deadline=time.monotonic() + 480, what=what, hint=f"; see {log}", poll=1.0)
        yield VllmServer(url, proc, log)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def vllm_server(base_dir: Path, modules: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """Every module on one host (module scope: stopped before the next module starts its own)."""
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    yield from serve_vllm(["--model", str(base_dir),
                           *(a for name, path in modules.items() for a in ("--module", f"{name}={path}"))], log)


N_TOKENS = 32


def messages_for(tag: str, instruction: str, chars: int = 2500) -> list[dict[str, str]]:
    """A fresh shared context (``tag`` makes it unique), then the agent's instruction."""
    return [{"role": "system", "content": f"You are a helpful team ({tag})."},
            {"role": "user", "content": "Read this code:\n" + inspect.getsource(os)[:chars]},
            {"role": "user", "content": instruction}]


@pytest.fixture(scope="module")
def oracle(base_dir: Path, modules: dict[str, Path]):
    """The torch engine in fp32 with the same modules: the project's reference."""
    return make_oracle(base_dir, modules)


def make_oracle(base_dir: Path, modules: dict[str, Path]):
    """``generate(agent, messages) -> (text, IP)``: N_TOKENS greedy tokens of the torch engine in
    fp32 on ``base_dir`` and ``modules``, and the prompt's invocation point."""
    from server.engine.build import load_engine
    from server.engine.sampling import SamplingParams
    from server.prompt import Placement, chat_prompt

    core = load_engine(base_dir, modules=modules, dtype="float32")

    def generate(agent: str, messages: list[dict[str, str]]) -> tuple[str, int]:
        prompt = chat_prompt(core.tokenizer, messages[:-1], messages[-1:])
        rid = uuid.uuid4().hex
        core.add_request(rid, agent, prompt, SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True))
        text = []
        while core.has_work:
            text += [e.text for e in core.step() if e.request_id == rid]
        return "".join(text), prompt.invocation_point(Placement.TURN)

    return generate


def chat(server: VllmServer, agent: str, messages: list[dict[str, str]], key: str = KEYS[0]) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                   json={"model": agent, "messages": messages, "max_tokens": N_TOKENS, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()
