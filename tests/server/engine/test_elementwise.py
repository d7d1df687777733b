"""The fused elementwise kernels: which steps use them, that they compute what the eager ops do,
and (tier model: a real AOTInductor build, for the default model's shape) their packages built
by the low-priority builder."""

from __future__ import annotations

import dataclasses
import fcntl
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from server.engine.batch import Chunk, SharedPrefix, plan_step
from server.engine.elementwise import (
    FUSED_MIN_ROWS,
    FusedSlot,
    Kernels,
    KernelSpec,
    eager_kernels,
    load,
    package_paths,
    start_build,
)
from server.engine.forward import LlamaForward
from server.kv.storage import KVStorage


def _forward(tiny_model_dir: Path, dtype: torch.dtype = torch.float32) -> LlamaForward:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return LlamaForward.from_hf(model, dtype=dtype)


def _counting(kernels: Kernels, calls: Counter[str]) -> Kernels:
    def wrap(name: str, fn):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*args)
        return call
    return Kernels(**{f.name: wrap(f.name, getattr(kernels, f.name)) for f in dataclasses.fields(Kernels)})


def _prefill(fwd: LlamaForward, n: int) -> torch.Tensor:
    kv = KVStorage(fwd.kv_spec(), num_blocks=n // 16 + 4, block_size=16)
    ids = torch.randint(0, fwd.weights.shape.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    return fwd(plan_step([Chunk(ids, start=0, slots=torch.arange(n))], block_size=16), kv)


def test_prefill_sized_steps_use_the_kernels_and_decode_steps_do_not(tiny_model_dir):
    fwd = _forward(tiny_model_dir)
    layers = fwd.weights.shape.num_layers
    eager = _prefill(fwd, FUSED_MIN_ROWS)
    calls: Counter[str] = Counter()
    fwd.fused.kernels = _counting(eager_kernels(fwd.weights.shape.rms_norm_eps), calls)
    fused = _prefill(fwd, FUSED_MIN_ROWS)
    assert calls == {"rms_norm": layers, "rope": layers, "add_rms_norm": layers, "silu_mul": layers}
    assert torch.equal(fused, eager)  # the regions, traced or not, are the eager math
    calls.clear()
    _prefill(fwd, FUSED_MIN_ROWS - 1)
    kv = KVStorage(fwd.kv_spec(), num_blocks=8, block_size=16)
    fwd(plan_step([Chunk(torch.arange(32), start=0, slots=torch.arange(32))], block_size=16), kv)
    fwd(plan_step([Chunk([5], start=32, slots=torch.tensor([32]), prefix=SharedPrefix(0, 32))], block_size=16), kv)
    assert not calls  # below FUSED_MIN_ROWS rows: eager


def test_a_spec_names_its_packages_by_shape_and_dtype(tiny_model_dir, tmp_path):
    fp32 = KernelSpec.of(_forward(tiny_model_dir).weights)
    bf16 = KernelSpec.of(_forward(tiny_model_dir, torch.bfloat16).weights)
    assert (fp32.hidden, fp32.heads, fp32.head_dim, fp32.qkv_width, fp32.intermediate) == (256, 6, 64, 512, 512)
    assert fp32.key() != bf16.key() and fp32.key() == KernelSpec.of(_forward(tiny_model_dir).weights).key()
    config = AutoConfig.from_pretrained(tiny_model_dir)  # what the build command reads: no weights loaded
    assert KernelSpec.from_config(config, torch.float32) == fp32 and KernelSpec.from_config(config, torch.bfloat16) == bf16
    paths = package_paths(fp32, tmp_path)
    assert sorted(paths) == sorted(f.name for f in dataclasses.fields(Kernels))
    assert load(fp32, tmp_path) is None  # nothing built: stay eager


def test_no_second_builder_starts_while_one_holds_the_lock(tiny_model_dir, tmp_path):
    spec = KernelSpec.of(_forward(tiny_model_dir).weights)
    lock_path = tmp_path / spec.key() / "build.lock"
    lock_path.parent.mkdir(parents=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert start_build(spec, tmp_path) is None
    slot = FusedSlot()
    slot.spec, slot.directory, slot.poll_s = spec, tmp_path, 3600.0
    assert slot.get() is None and slot.get() is None  # looked once, not again before poll_s


@pytest.mark.timeout(600)  # a real AOTInductor build of four regions: 46-60 s on a 2-core host, beside other tests
def test_a_real_build_loads_and_equals_the_eager_forward(default_model, tmp_path):
    """The low-priority builder compiles the four regions (AOTInductor, rows dynamic) for the
    default model (what a first serving process on a machine builds); the slot loads them once
    there; prefill-sized steps of any length then give the eager logits."""
    fwd = _forward(default_model)
    spec = KernelSpec.of(fwd.weights)
    proc = start_build(spec, tmp_path)
    assert proc is not None
    assert proc.wait(timeout=600) == 0, (tmp_path / spec.key() / "build.log").read_text()[-2000:]
    again = start_build(spec, tmp_path)  # the lock is free again: this one finds them built
    assert again is not None and again.wait(timeout=120) == 0
    slot = FusedSlot()
    assert slot.await_build(spec, tmp_path)
    for n in (FUSED_MIN_ROWS, 200, 1000):
        fwd.fused.kernels = None
        eager = _prefill(fwd, n)
        fwd.fused.kernels = slot.kernels
        torch.testing.assert_close(_prefill(fwd, n), eager, atol=1e-4, rtol=1e-4)  # fp32: sums reordered
    started = time.perf_counter()
    assert load(spec, tmp_path) is not None and time.perf_counter() - started < 30


def test_a_failed_build_is_reported_once_and_the_engine_stays_eager(tiny_model_dir, tmp_path, caplog):
    slot = FusedSlot()
    slot.spec, slot.directory, slot.poll_s = KernelSpec.of(_forward(tiny_model_dir).weights), tmp_path, 0.0
    slot.builder = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    slot.builder.wait()
    with caplog.at_level("WARNING", logger="agentshare.engine"):
        assert slot.get() is None and slot.get() is None
    failed = [r for r in caplog.records if getattr(r, "state", None) == "failed"]
    assert len(failed) == 1 and failed[0].exit == 3 and slot.spec is None
