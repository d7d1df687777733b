"""A layer's elementwise work, eager and fused: RMSNorm, the residual add with the next RMSNorm,
RoPE on q and k, SiLU(gate)·up.

Eager torch runs each as several passes over the step's rows (RMSNorm alone: cast, square,
mean, add, rsqrt, multiply, cast, scale). On a prefill-sized step that is a third of the time
(2,048 tokens, default model, 2 threads); fused, each region reads its rows once. The fused
kernels are compiled ahead of time with AOTInductor, with the row count dynamic, and cached on
disk per model shape, dtype, torch version and CPU (:class:`KernelSpec`): a process loads them in
milliseconds, and only the first on a machine pays the compile, in a low-priority process of
its own (:func:`start_build`; the engine serves eagerly meanwhile and loads them when they are
there: :class:`FusedSlot`). Steps of fewer than :data:`FUSED_MIN_ROWS` rows stay eager: at
decode sizes a kernel call costs what the eager ops do.

The packages live in ``kernels/`` of the machine's cache (``$AGENTSHARE_CACHE_DIR``, default
``~/.cache/agentshare``); ``AGENTSHARE_FUSED=off`` turns the fused path off in serving processes. Build by hand (prints
where the packages went)::

    python -m server.engine.elementwise build --model-dir PATH --dtype bfloat16

>>> x = torch.tensor([[3.0, 4.0]])
>>> h, y = add_rms_norm(x, x, torch.ones(2), 0.0)
>>> h.tolist(), [round(v, 4) for v in y[0].tolist()]
([[6.0, 8.0]], [0.8485, 1.1314])
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import functools
import hashlib
import inspect
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from server import paths
from server.engine.rope import Rope, apply_rope
from server.engine.weights import ModelShape, ModelWeights

log = logging.getLogger("agentshare.engine")

FUSED_MIN_ROWS = 64
"""Steps with at least this many rows use the fused kernels (when loaded)."""

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the Llama family computes it: normalise in fp32, scale in the input dtype.

    >>> y = rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), 0.0)
    >>> [round(v, 4) for v in y[0].tolist()]
    [0.8485, 1.1314]
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding ``delta``, and its RMSNorm."""
    h = h + delta
    return h, rms_norm(h, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up of a packed ``[gate | up]`` projection output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True, slots=True)
class Kernels:
    """The four regions, each ``fn(*tensors)`` (eps baked in where it applies)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


REGIONS = tuple(f.name for f in dataclasses.fields(Kernels))


def eager_kernels(eps: float) -> Kernels:
    """The regions as eager torch (what the fused kernels are traced from)."""
    return Kernels(lambda x, w: rms_norm(x, w, eps), lambda h, d, w: add_rms_norm(h, d, w, eps), apply_rope, silu_mul)


class Regions(Protocol):
    """A layer's elementwise regions as the forward calls them, whichever kernels compute them:
    torch's ops (:class:`TorchRegions`: eager, or the fused kernels) or vLLM's
    (:class:`~server.engine.vllm_elementwise.VllmRegions`). ``add_rms_norm`` and ``rope`` may
    write into their inputs."""

    def tables(self, rope: Rope, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """What :meth:`rope` reads for a step's ``positions`` [T], made once a step."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``h + delta`` and its RMSNorm."""
        ...

    def rope(self, qkv: torch.Tensor, heads: int, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The first ``heads`` heads of the rows ``qkv`` [T, width] (q's, then k's) rotated, as
        [T, heads, head_dim]."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class TorchRegions:
    """:class:`Regions` on torch: the eager ops, or the fused kernels (``fused=True``: their
    inputs made contiguous, as traced; RoPE fused only on a contiguous ``qkv``).

    >>> r = TorchRegions(eager_kernels(0.0))
    >>> h, x = r.add_rms_norm(torch.tensor([[3.0, 4.0]]), torch.zeros(1, 2), torch.ones(2))
    >>> h.tolist(), [round(v, 4) for v in x[0].tolist()]
    ([[3.0, 4.0]], [0.8485, 1.1314])
    """

    __slots__ = ("_fused", "_k")

    def __init__(self, kernels: Kernels, *, fused: bool = False) -> None:
        self._k, self._fused = kernels, fused

    def tables(self, rope: Rope, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return rope.tables(positions, dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._k.rms_norm(x.contiguous() if self._fused else x, weight)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fused:
            h, delta = h.contiguous(), delta.contiguous()
        return self._k.add_rms_norm(h, delta, weight)

    def rope(self, qkv: torch.Tensor, heads: int, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
        t, width = qkv.shape[0], tables[0].shape[-1]
        fn = self._k.rope if self._fused and qkv.is_contiguous() else apply_rope
        return fn(qkv[:, : heads * width].view(t, heads, width), *tables)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._k.silu_mul(gate_up.contiguous() if self._fused else gate_up)


@functools.cache
def eager_regions(eps: float) -> TorchRegions:
    """The eager regions for one norm epsilon (one object per model)."""
    return TorchRegions(eager_kernels(eps))


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """What a set of fused kernels is compiled for."""

    hidden: int
    heads: int  # query heads + KV heads: RoPE runs on both at once
    head_dim: int
    qkv_width: int  # the qkv projection's output: RoPE's input is a view into it
    intermediate: int
    eps: float
    dtype: str

    @classmethod
    def of(cls, weights: ModelWeights) -> KernelSpec:
        """For a forward's weights."""
        return cls._of(weights.shape, weights.layers[0].gate_up.weight.shape[0] // 2, weights.dtype)

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype) -> KernelSpec:
        """For a transformers config, without loading the weights (the same spec as :meth:`of`)."""
        return cls._of(ModelShape.from_config(config), int(config.intermediate_size), dtype)

    @classmethod
    def _of(cls, s: ModelShape, intermediate: int, dtype: torch.dtype) -> KernelSpec:
        return cls(s.hidden_size, s.num_heads + s.num_kv_heads, s.head_dim, s.q_size + 2 * s.kv_size, intermediate,
                   s.rms_norm_eps, str(dtype).removeprefix("torch."))

    def key(self) -> str:
        """Names the packages: the spec, torch's version, the CPU's vector ISA and the source
        of the regions and of how they are traced (a change to either rebuilds them)."""
        blob = json.dumps([asdict(self), torch.__version__, torch.backends.cpu.get_cpu_capability(), _source()],
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]


@functools.cache
def _source() -> str:
    return "".join(inspect.getsource(f) for f in (rms_norm, add_rms_norm, silu_mul, apply_rope, _examples, build))


def cache_dir() -> Path:
    """``kernels/`` under the machine's agentshare cache (``server.paths``)."""
    return paths.cache_dir() / "kernels"


def spec_dir(spec: KernelSpec, directory: Path | None = None) -> Path:
    """Where ``spec``'s packages, its builder's lock and its ``build.log`` live."""
    return (directory or cache_dir()) / spec.key()


def package_paths(spec: KernelSpec, directory: Path | None = None) -> dict[str, Path]:
    return {name: spec_dir(spec, directory) / f"{name}.pt2" for name in REGIONS}


class _Region(torch.nn.Module):
    def __init__(self, fn: Callable[..., object]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> object:
        return self.fn(*args)


def _examples(spec: KernelSpec, rows: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Inputs laid out as the forward passes them (RoPE: a view into the qkv output)."""
    dt = getattr(torch, spec.dtype)
    h = torch.randn(rows, spec.hidden, dtype=dt)
    w = torch.randn(spec.hidden, dtype=dt)
    qk = torch.randn(rows, spec.qkv_width, dtype=dt)[:, : spec.heads * spec.head_dim].view(rows, spec.heads, spec.head_dim)
    cs = torch.randn(rows, spec.head_dim, dtype=dt)
    return {"rms_norm": (h, w), "add_rms_norm": (h, h.clone(), w), "rope": (qk, cs, cs.clone()),
            "silu_mul": (torch.randn(rows, 2 * spec.intermediate, dtype=dt),)}


def build(spec: KernelSpec, directory: Path | None = None, *, progress: Callable[[str], None] = lambda _: None) -> dict[str, Path]:
    """Compile the four regions for ``spec`` (rows dynamic) into packages; skips those present.
    Each package is written under a temporary name and renamed into place, so a reader never
    sees half of one."""
    paths = package_paths(spec, directory)
    eager = eager_kernels(spec.eps)
    examples = _examples(spec, rows=FUSED_MIN_ROWS)
    rows = torch.export.Dim("rows", min=2, max=1 << 20)
    for name, path in paths.items():
        if path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        args = examples[name]
        dynamic = tuple({0: rows} if a.dim() > 1 else None for a in args)
        program = torch.export.export(_Region(getattr(eager, name)), args, dynamic_shapes=(dynamic,))  # *args: one input
        tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
        os.replace(tmp, path)
        progress(f"{name}: {time.perf_counter() - started:.1f} s")
    return paths


def load(spec: KernelSpec, directory: Path | None = None) -> Kernels | None:
    """The fused kernels for ``spec`` if all are built, else None."""
    paths = package_paths(spec, directory)
    if not all(p.exists() for p in paths.values()):
        return None
    runners = {name: torch._inductor.aoti_load_package(str(p)) for name, p in paths.items()}
    return Kernels(**runners)


def start_build(spec: KernelSpec, directory: Path | None = None) -> subprocess.Popen[bytes] | None:
    """Build the kernels in a low-priority process of their own (one thread, nice 19), unless
    another process is building them; its output goes to ``build.log`` beside the packages."""
    lock_path = _lock_path(spec, directory)
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a builder holds it
        fcntl.flock(lock, fcntl.LOCK_UN)
    cmd = [sys.executable, "-m", "server.engine.elementwise", "build", "--spec", json.dumps(asdict(spec)),
           "--dir", str(directory or cache_dir())]
    nice = shutil.which("nice")  # not preexec_fn: unsafe in a process with threads
    if nice:
        cmd = [nice, "-n", "19", *cmd]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with open(lock_path.with_name("build.log"), "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


class FusedSlot:
    """The fused kernels of one forward: absent, awaited from a builder, or loaded.

    :meth:`get` is called once per prefill-sized step; while kernels are awaited it looks for
    them at most every ``poll_s`` seconds, loads them once built, and gives None until then."""

    def __init__(self) -> None:
        self.kernels: Kernels | None = None
        self.spec: KernelSpec | None = None
        self.directory: Path | None = None
        self.builder: subprocess.Popen[bytes] | None = None
        self._next_poll = 0.0
        self.poll_s = 2.0

    def await_build(self, spec: KernelSpec, directory: Path | None = None) -> bool:
        """Load the kernels if built, else start their builder and look for them later; True
        if loaded now."""
        self.spec, self.directory = spec, directory
        self.kernels = load(spec, directory)
        if self.kernels is None:
            self.builder = start_build(spec, directory)
            log.info("fused kernels: building", extra={"event": "fused_kernels", "state": "building", "key": spec.key(),
                                                        "builder": self.builder.pid if self.builder else None})
        return self.kernels is not None

    def get(self) -> Kernels | None:
        if self.kernels is None and self.spec is not None and time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + self.poll_s
            if self.builder is not None and self.builder.poll() not in (None, 0):  # it failed: say so once
                log.warning("fused kernels: the build failed; staying eager",
                            extra={"event": "fused_kernels", "state": "failed", "exit": self.builder.returncode,
                                   "log": str(spec_dir(self.spec, self.directory) / "build.log")})
                self.spec = None
                return None
            try:
                self.kernels = load(self.spec, self.directory)
            except Exception as exc:  # a broken package: stay eager, say why once
                log.warning("fused kernels failed to load; staying eager",
                            extra={"event": "fused_kernels", "state": "failed", "why": f"{type(exc).__name__}: {exc}"})
                self.spec = None
            if self.kernels is not None:
                log.info("fused kernels loaded", extra={"event": "fused_kernels", "state": "loaded", "key": self.spec and self.spec.key()})
        return self.kernels


def _main() -> None:
    ap = argparse.ArgumentParser(prog="python -m server.engine.elementwise", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the fused kernels of a model (or of a --spec) into the cache")
    b.add_argument("--model-dir", type=Path, help="default: the default model")
    b.add_argument("--dtype", default="auto")
    b.add_argument("--spec", help="a KernelSpec as JSON (what a serving process passes)")
    b.add_argument("--dir", type=Path, help="the kernel cache (default: kernels/ in $AGENTSHARE_CACHE_DIR)")
    args = ap.parse_args()
    if args.spec:
        spec = KernelSpec(**json.loads(args.spec))
    else:
        from server.engine.numerics import resolve_dtype
        from server.models.loader import load_model
        from server.models.patch import resolve_model_dir

        spec = KernelSpec.from_config(load_model(resolve_model_dir(args.model_dir)).model.config,
                                      resolve_dtype(args.dtype))
    with open(_lock_path(spec, args.dir), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per spec on this machine; a second waits, then finds them
        print(f"building fused kernels for {asdict(spec)} into {spec_dir(spec, args.dir)}", flush=True)
        build(spec, args.dir, progress=lambda line: print(line, flush=True))
    print("done", flush=True)


def _lock_path(spec: KernelSpec, directory: Path | None) -> Path:
    d = spec_dir(spec, directory)
    d.mkdir(parents=True, exist_ok=True)
    return d / "build.lock"


if __name__ == "__main__":
    _main()
