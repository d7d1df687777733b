"""The device rule (``server/engine/device.py``) and an engine whose tensors live off the CPU.

No CUDA device is needed here: torch's ``meta`` device stands in for one. A step on it runs
every op of the scheduler, the runner, the LoRA bank, the layer split and the forward, and
raises where a tensor of another device meets the step's (``Tensor on device cpu is not on
the expected device meta``) or where the step would read a device value back to the host
(``Cannot copy out of meta tensor``), the two mistakes that only a GPU would otherwise show.
"""

from __future__ import annotations

import logging

import pytest
import torch

from server.engine import attention
from server.engine.attention import Partial, _checked_device_partial, reference_partial
from server.engine.core import EngineConfig, EngineCore
from server.engine.device import kv_pool_bytes, resolve_device, step_workspace_bytes
from server.engine.forward import LlamaForward
from server.engine.modules import base_module, load_module
from server.engine.sampling import SamplingParams
from server.kv.errors import KVAllocationError
from server.kv.family import family_digest
from server.models.loader import load_model
from server.prompt import chat_prompt
from tests.server.engine.test_core import CONTEXT, FORCED, drain, turn

META = torch.device("meta")


# ---- which device ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["auto", "AUTO", None, "cpu", " cpu "])
def test_without_cuda_auto_and_cpu_are_the_cpu(spec):
    assert resolve_device(spec, cuda_count=lambda: 0) == torch.device("cpu")


def test_the_device_left_out_is_auto(monkeypatch):
    assert resolve_device(cuda_count=lambda: 0) == torch.device("cpu")
    assert resolve_device(cuda_count=lambda: 1) == torch.device("cuda", 0)


def test_without_cuda_visible_devices_the_error_does_not_name_it(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ValueError) as err:
        resolve_device("cuda:0", cuda_count=lambda: 0)
    assert "CUDA_VISIBLE_DEVICES" not in str(err.value) and "torch sees no CUDA device (torch" in str(err.value)


def test_auto_takes_the_first_visible_cuda_device():
    assert resolve_device("auto", cuda_count=lambda: 3) == torch.device("cuda", 0)
    assert resolve_device("cuda", cuda_count=lambda: 3) == torch.device("cuda", 0)
    assert resolve_device(torch.device("cuda", 2), cuda_count=lambda: 3) == torch.device("cuda", 2)


def test_cuda_without_a_device_says_what_to_use_instead(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match=r"torch sees no CUDA device \(CUDA_VISIBLE_DEVICES=''\).*--device cpu"):
        resolve_device("cuda", cuda_count=lambda: 0)


def test_a_device_index_past_the_visible_ones_names_the_range():
    with pytest.raises(ValueError, match=r"sees 2 CUDA device\(s\), cuda:0 .. cuda:1"):
        resolve_device("cuda:2", cuda_count=lambda: 2)


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cpu:0", "auto:1", "mps", "cuda:-1"])
def test_a_device_that_is_no_device_is_refused(spec):
    with pytest.raises(ValueError, match="is not one of auto, cpu, cuda, cuda:N"):
        resolve_device(spec, cuda_count=lambda: 1)


# ---- how much KV ---------------------------------------------------------------------------------

GIB = 1 << 30
CUDA0 = torch.device("cuda", 0)


def test_the_cuda_pool_is_the_utilisation_share_less_what_is_used_and_the_workspace():
    # 80 GiB device, 16 GiB in use (weights, other processes): 0.9 * 80 - 16 - 1 = 55 GiB
    got = kv_pool_bytes(CUDA0, requested=None, utilization=0.9, workspace=GIB, memory=lambda d: (64 * GIB, 80 * GIB))
    assert got == int(0.9 * 80 * GIB) - 16 * GIB - GIB


def test_a_requested_pool_that_fits_is_kept_and_one_that_does_not_is_refused_with_the_numbers():
    mem = lambda d: (10 * GIB, 80 * GIB)  # noqa: E731
    assert kv_pool_bytes(CUDA0, requested=8 * GIB, utilization=0.9, workspace=GIB, memory=mem) == 8 * GIB
    with pytest.raises(KVAllocationError, match=r"10.0 GiB free of 80.0 GiB.*at most 9.0 GiB"):
        kv_pool_bytes(CUDA0, requested=9 * GIB + 1, utilization=0.9, workspace=GIB, memory=mem)


def test_the_pool_reads_the_memory_of_its_own_device_and_takes_all_it_may():
    asked = []

    def memory(device):
        asked.append(device)
        return 10 * GIB, 10 * GIB

    assert kv_pool_bytes(torch.device("cuda", 3), requested=None, utilization=1.0, workspace=GIB, memory=memory) == 9 * GIB
    assert asked == [torch.device("cuda", 3)]
    # exactly what fits is kept; a pool of one byte is a pool
    assert kv_pool_bytes(CUDA0, requested=9 * GIB, utilization=0.5, workspace=GIB, memory=memory) == 9 * GIB
    assert kv_pool_bytes(CUDA0, requested=None, utilization=0.5, workspace=4 * GIB - 1,
                         memory=lambda d: (9 * GIB, 10 * GIB)) == 1


def test_no_room_left_under_the_utilisation_is_an_error_not_an_empty_pool():
    with pytest.raises(KVAllocationError, match="no room for a KV pool"):  # exactly nothing left
        kv_pool_bytes(CUDA0, requested=None, utilization=0.5, workspace=4 * GIB, memory=lambda d: (9 * GIB, 10 * GIB))
    with pytest.raises(KVAllocationError, match="raise --gpu-memory-utilization"):
        kv_pool_bytes(CUDA0, requested=None, utilization=0.5, workspace=GIB, memory=lambda d: (40 * GIB, 80 * GIB))


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01])
def test_the_utilisation_is_a_fraction(utilization):
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        kv_pool_bytes(CUDA0, requested=None, utilization=utilization, workspace=0, memory=lambda d: (GIB, GIB))
    with pytest.raises(ValueError, match=r"memory_utilization must lie in \(0, 1\]"):
        EngineConfig(memory_utilization=utilization)


def test_the_cpu_pool_is_the_size_asked_for_or_one_gib():
    assert kv_pool_bytes(torch.device("cpu"), requested=None, utilization=0.9, workspace=GIB) == GIB
    assert kv_pool_bytes(torch.device("cpu"), requested=123, utilization=0.9, workspace=GIB) == 123


def test_the_workspace_is_twice_the_widest_rows_and_the_logits():
    # (4 * 10 + 3 * 20 + 2 * 30) * 2 bytes = 320 a token; 3 rows of 1000 fp32 logits
    assert step_workspace_bytes(tokens=100, rows=3, hidden=10, intermediate=20, qkv=30, vocab=1000,
                                itemsize=2) == 2 * (100 * 320 + 3 * 1000 * 4)
    assert step_workspace_bytes(tokens=7, rows=5, hidden=3, intermediate=11, qkv=13, vocab=17,
                                itemsize=4) == 2 * (7 * (4 * 3 + 3 * 11 + 2 * 13) * 4 + 5 * 17 * 4)


def test_the_workspace_grows_with_the_step_and_the_vocabulary():
    small = step_workspace_bytes(tokens=512, rows=8, hidden=576, intermediate=1536, qkv=960, vocab=49152, itemsize=2)
    assert step_workspace_bytes(tokens=2048, rows=8, hidden=576, intermediate=1536, qkv=960, vocab=49152,
                                itemsize=2) > small
    assert step_workspace_bytes(tokens=512, rows=64, hidden=576, intermediate=1536, qkv=960, vocab=49152,
                                itemsize=2) > small


# ---- an engine off the CPU -----------------------------------------------------------------------


def meta_engine(model_dir, modules, graphs: str = "off") -> EngineCore:
    """The engine of ``load_engine``, with its weights, modules and KV on the meta device; the
    logits' copy to the host gives zeros of their shape (a meta tensor holds no values)."""
    loaded = load_model(model_dir)
    forward = LlamaForward.from_hf(loaded.model, dtype=torch.float32, device=META)
    family = family_digest(model_dir, kv_dtype="float32")
    table = {"base": base_module(family)}
    for name, path in modules.items():
        table[name] = load_module(path, name=name, family=family, base_families={family}, shape=forward.weights.shape,
                                  dtype=torch.float32, device=META)
    core = EngineCore(forward, loaded.tokenizer, family=family, modules=table,
                      config=EngineConfig(kv_cache_bytes=16 << 20, max_step_tokens=64, decode_graphs=graphs))
    core.runner.to_host = lambda t: torch.zeros(t.shape, dtype=t.dtype)  # type: ignore[method-assign]
    return core


@pytest.mark.parametrize("graphs", ["off", "padded"])
def test_every_kind_of_step_runs_on_another_device_without_mixing_devices_or_reading_back(
    tiny_model_dir, smollm2_tokenizer, make_lora, make_full, graphs
):
    """``padded``: the decode steps a CUDA graph would capture, too."""
    modules = {"coder": make_lora("coder"), "planner": make_lora("planner", seed=3),
               "split": make_lora("split-meta", seed=5, recompute_layers=1), "full": make_full("full-meta")}
    core = meta_engine(tiny_model_dir, modules, graphs)
    assert core.kv.device == META and core.kv.k[0].device == META and core.kv.hidden
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    core.add_context("ctx", prompt.token_ids[: prompt.context_len], ttl=60)  # chunked prefill (64 a step)
    drain(core)
    params = SamplingParams(temperature=0, max_tokens=4, forced_tokens=FORCED[:4], ignore_eos=True)
    longer = SamplingParams(temperature=0, max_tokens=6, forced_tokens=FORCED, ignore_eos=True)
    for name in ["base", *modules]:  # shared prefix, the modules' rows, a fill, a full module's own call
        core.add_request(name, name, prompt, longer if name == "coder" else params)  # it decodes alone at the end
    events = drain(core)
    for name in ["base", *modules]:
        want = FORCED if name == "coder" else FORCED[:4]
        assert [e.token_id for e in events[name] if e.token_id is not None] == list(want), events[name][-1]
    assert core.stats.recomputed_prefix_tokens > 0  # the split module filled from the family's blocks
    assert core.stats.module_rows > 0
    assert graphs == "off" or core.runner.graphs.replays > 0  # type: ignore[union-attr]


def test_a_step_that_mixes_devices_fails_on_the_meta_stand_in(tiny_model_dir, smollm2_tokenizer, monkeypatch):
    """The stand-in catches what it claims to: the step's index tensors left on the CPU fail."""
    from server.engine import runner

    core = meta_engine(tiny_model_dir, {})
    core.runner.device = torch.device("cpu")  # plan_step then leaves the step's tensors on the host
    core.add_request("r", "base", chat_prompt(smollm2_tokenizer, CONTEXT, turn("Hi")), SamplingParams(max_tokens=1))
    events = drain(core)["r"]
    assert runner.ModelRunner.to_host is not None
    assert events[-1].error is not None and "not on the expected device" in events[-1].error


# ---- the device attention kernel is checked before it serves -------------------------------------


def _inputs(mask: bool = False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 16, generator=g) for _ in range(3))
    m = torch.zeros(2, 1, 1, 5)
    m[0, ..., 3:] = float("-inf")
    return q, k, v, (m if mask else None)


def test_a_kernel_that_agrees_serves_its_kind_from_the_second_call(monkeypatch):
    monkeypatch.setattr(attention, "KERNELS", {})
    calls = []

    def kernel(q, k, v, *, causal=False, mask=None, scale=None):
        calls.append(causal)
        return reference_partial(q, k, v, causal=causal, mask=mask, scale=scale)

    monkeypatch.setattr(attention, "efficient_partial", kernel)
    q, k, v, m = _inputs(mask=True)
    first = _checked_device_partial(q, k, v, causal=False, mask=m, scale=None)
    assert attention.KERNELS == {("cpu", "float32", False, True): "efficient"}
    second = _checked_device_partial(q, k, v, causal=False, mask=m, scale=None)
    assert len(calls) == 2 and torch.equal(first.out, second.out)


def test_a_kernel_that_refuses_a_later_call_of_its_kind_leaves_that_call_to_the_reference(monkeypatch, caplog):
    monkeypatch.setattr(attention, "KERNELS", {("cpu", "float32", False, False): "efficient"})

    def kernel(q, k, v, *, causal=False, mask=None, scale=None):
        raise RuntimeError("this layout is not supported")

    monkeypatch.setattr(attention, "efficient_partial", kernel)
    q, k, v, _ = _inputs()
    with caplog.at_level(logging.WARNING, logger="agentshare.engine"):
        got = _checked_device_partial(q, k, v, causal=False, mask=None, scale=None)
    assert torch.equal(got.out, reference_partial(q, k, v).out)
    assert any("refused a call" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fault", ["disagrees", "raises", "lse"])
def test_a_kernel_that_disagrees_or_fails_is_logged_and_the_reference_serves(monkeypatch, caplog, fault):
    monkeypatch.setattr(attention, "KERNELS", {})
    calls = []

    def kernel(q, k, v, *, causal=False, mask=None, scale=None):
        calls.append(1)
        if fault == "raises":
            raise NotImplementedError("no kernel for these inputs")
        ref = reference_partial(q, k, v, causal=causal, mask=mask, scale=scale)
        if fault == "lse":
            return Partial(ref.out, ref.lse + 0.01)
        return Partial(ref.out + 0.01, ref.lse)

    monkeypatch.setattr(attention, "efficient_partial", kernel)
    q, k, v, _ = _inputs()
    with caplog.at_level(logging.WARNING, logger="agentshare.engine"):
        got = _checked_device_partial(q, k, v, causal=True, mask=None, scale=None)
    assert torch.equal(got.out, reference_partial(q, k, v, causal=True).out)
    assert attention.KERNELS[("cpu", "float32", True, False)] == "reference"
    assert any(getattr(r, "event", None) == "attention_kernel" for r in caplog.records)
    _checked_device_partial(q, k, v, causal=True, mask=None, scale=None)
    assert len(calls) == 1  # never asked again


def test_the_flash_kernel_is_tried_first_for_unmasked_half_precision_and_the_next_candidate_serves_if_it_disagrees(
        monkeypatch, caplog):
    monkeypatch.setattr(attention, "KERNELS", {})
    calls: list[str] = []

    def flash(q, k, v, *, causal=False, mask=None, scale=None):
        calls.append("flash")
        ref = reference_partial(q, k, v, causal=causal, mask=mask, scale=scale)
        return Partial(ref.out + 0.5, ref.lse)  # wrong: must not serve

    def efficient(q, k, v, *, causal=False, mask=None, scale=None):
        calls.append("efficient")
        return reference_partial(q, k, v, causal=causal, mask=mask, scale=scale)

    monkeypatch.setattr(attention, "flash_partial", flash)
    monkeypatch.setattr(attention, "efficient_partial", efficient)
    q, k, v = (t.to(torch.bfloat16) for t in _inputs()[:3])
    with caplog.at_level(logging.WARNING, logger="agentshare.engine"):
        _checked_device_partial(q, k, v, causal=True, mask=None, scale=None)
    assert calls == ["flash", "efficient"]
    assert attention.KERNELS == {("cpu", "bfloat16", True, False): "efficient"}
    assert [getattr(r, "kernel", None) for r in caplog.records if getattr(r, "event", None) == "attention_kernel"] \
        == ["flash"]
    _checked_device_partial(q, k, v, causal=True, mask=None, scale=None)
    assert calls == ["flash", "efficient", "efficient"]
    # a masked kind never asks the flash kernel
    _, _, _, mask = _inputs(mask=True)
    _checked_device_partial(q, k, v, causal=False, mask=mask.to(torch.bfloat16), scale=None)
    assert calls[3:] == ["efficient"] and attention.KERNELS[("cpu", "bfloat16", False, True)] == "efficient"
