"""Plan, start and supervise the vLLM instances of ``agentshare serve --engine vllm``.

::

    base        the base model; computes every shared prefix and saves it to the store
                (compiled unless --enforce-eager; vLLM compiles nothing once LoRA is on)
    lora-<i>    the base with the LoRA modules dealt to it (round-robin, as the cluster deals
                agents to decode workers); loads the prefix of every module that joins the family
    full-<name> one per full module (another model directory of the family)

Every instance runs ``python -m vllm.entrypoints.openai.api_server`` with this package's
connector (:mod:`server.vllm.connector`) on ``127.0.0.1`` and a port of its own: the store's
requests carry a tenant's salt, so no instance may be reachable from the network. A supervisor
thread restarts an instance that exits (with a back-off) and says which are down, for
``/health``.

>>> from server.kv.family import base_families, family_digest
>>> family = family_digest(model_dir, kv_dtype="float32")
>>> plan = plan_instances(model_dir, {"coder": coder_dir}, family=family, dtype="float32",
...                       base_families=base_families(model_dir))
>>> [(s.name, sorted(s.loras)) for s in plan]
[('base', []), ('lora-0', ['coder'])]
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from server.backend import AgentCard
from server.cluster.shm import shm_dir
from server.modules.manifest import Manifest, ModuleKind
from server.modules.registry import Identified, identify
from server.process import die_with_parent, free_port, wait_ready

log = logging.getLogger("agentshare.vllm")

BASE = "base"


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One vLLM instance: what it serves and how it shares."""

    name: str
    model: Path
    served: str  # the model name requests name (the base's, or the full module's)
    loras: Mapping[str, Path] = field(default_factory=dict)
    max_lora_rank: int = 0
    modules: Mapping[str, str | None] = field(default_factory=dict)
    """Each agent this instance serves -> the family its manifest names (None: no manifest)."""
    compile: bool = True


def _identify(path: Path, *, name: str, family: str, base_families: Collection[str] | None = None) -> Identified:
    """The module at ``path``, as the torch engine identifies it (``base_families``: see
    :func:`~server.modules.registry.identify`); one this engine cannot serve exactly (the layer
    split) is refused."""
    ident = identify(path, name=name, family=family, base_families=base_families)
    if ident.recompute_layers:
        raise ValueError(f"module {name!r} recomputes its top {ident.recompute_layers} layers over the prefix "
                         "(recompute_layers in its manifest): the vllm engine cannot serve the layer split; "
                         "serve it with the torch engine (agentshare serve without --engine vllm)")
    return ident


def agent_card(path: Path, *, name: str, family: str) -> AgentCard:
    """What clients may know of the agent whose module is at ``path`` (whether it shares the base's
    prefill, and why), as the torch engine says it."""
    ident = _identify(path, name=name, family=family)
    return AgentCard(name, ident.kind, family if ident.shares_prefill else None, ident.shares_prefill,
                     str(ident.placement), ident.reason, fidelity=ident.fidelity)


def _lora_rank(path: Path) -> int:
    cfg = json.loads((path / "adapter_config.json").read_text())
    return int(cfg.get("r", 8))


def plan_instances(
    model_dir: Path, modules: Mapping[str, Path], *, family: str, dtype: str, base_families: Collection[str],
    lora_instances: int = 1, base_name: str = BASE, enforce_eager: bool = False, with_base: bool = True,
) -> list[InstanceSpec]:
    """The instances that serve ``modules`` beside the base (see the module docstring); without
    the base instance on a node (:mod:`server.vllm.node`), whose prefixes another host computes.
    ``base_families``: the base's family at every KV dtype (:func:`server.kv.family.base_families`);
    a LoRA trained on another base is refused."""
    if lora_instances < 1:
        raise ValueError("lora_instances must be at least 1")
    loras: list[tuple[str, Path, str | None]] = []
    full: list[tuple[str, Path, str | None]] = []
    for name, path in modules.items():
        ident = _identify(path, name=name, family=family, base_families=base_families)
        manifest = Manifest.read(Path(path))
        named = manifest.family if manifest is not None else None
        (loras if ident.kind == ModuleKind.LORA else full).append((name, Path(path), named))
    plan = [InstanceSpec(BASE, model_dir, base_name, modules={base_name: family}, compile=not enforce_eager)
            ] if with_base else []
    groups = [loras[i::lora_instances] for i in range(lora_instances)]
    for i, group in enumerate(g for g in groups if g):
        plan.append(InstanceSpec(
            f"lora-{i}", model_dir, base_name, loras={n: p for n, p, _ in group},
            max_lora_rank=max(_lora_rank(p) for _, p, _ in group),
            modules={base_name: family, **{n: f for n, _, f in group}}, compile=False,
        ))
    for name, path, named in full:
        plan.append(InstanceSpec(f"full-{name}", path, name, modules={name: named}, compile=not enforce_eager))
    return plan


def _rank_bucket(rank: int) -> int:
    """vLLM accepts a max LoRA rank from a fixed set; the smallest that holds ``rank``."""
    for r in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= r:
            return r
    raise ValueError(f"LoRA rank {rank} is larger than vLLM supports (512)")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    root: Path
    capacity_bytes: int
    family: str


def command(spec: InstanceSpec, *, port: int, dtype: str, store: StoreConfig, max_model_len: int,
            kv_cache_bytes: int, tensor_parallel: int = 1, python: str = sys.executable) -> list[str]:
    """The command line that starts ``spec`` (vLLM's own options); ``tensor_parallel`` ranks each
    (every instance of a host alike: the store's format carries the rank count)."""
    extra = {"store": str(store.root), "capacity_bytes": store.capacity_bytes, "family": store.family,
             "served": spec.served, "modules": dict(spec.modules)}
    kv = {"kv_connector": "AgentshareConnector", "kv_connector_module_path": "server.vllm.connector",
          "kv_role": "kv_both", "kv_connector_extra_config": extra,
          "kv_load_failure_policy": "fail"}  # a prefix that fails to load fails its request, never recomputed
    args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(spec.model),
            "--served-model-name", spec.served, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--enable-prefix-caching",
            "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv),
            "--disable-uvicorn-access-log"]
    if tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(tensor_parallel)]
    if not spec.compile:
        args.append("--enforce-eager")
    if spec.loras:
        args += ["--enable-lora", "--max-loras", str(len(spec.loras)),
                 "--max-lora-rank", str(_rank_bucket(spec.max_lora_rank)), "--lora-modules",
                 *(f"{n}={p}" for n, p in spec.loras.items())]
    return args


@dataclass(slots=True)
class Instance:
    spec: InstanceSpec
    port: int
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None
    starts: int = 0
    ready: bool = False
    shm: set[Path] = field(default_factory=set)  # the segments it maps, removed when it stops

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


SHM = Path("/dev/shm")  # where shm_open puts segments (vLLM's, multiprocessing's) on Linux


def _sessions(proc: Path) -> Iterator[tuple[Path, str, int]]:
    """(its /proc directory, state, session) of every process this one may read."""
    for d in proc.iterdir():
        if d.name.isdigit():
            try:
                # state and session are the 1st and 4th fields after the command name, which is in
                # parentheses and may hold anything
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                yield d, fields[0], int(fields[3])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile


def _shm_maps(proc: Path) -> Iterator[tuple[int, set[Path]]]:
    """(session, the segments directly under /dev/shm it maps) of every process this one may read."""
    for d, _, session in _sessions(proc):
        try:
            maps = (d / "maps").read_text()
        except OSError:
            continue  # exited meanwhile, or not ours to read
        segments: set[Path] = set()
        for line in maps.splitlines():
            fields = line.split(None, 5)  # address, perms, offset, device, inode, path (may hold spaces)
            if len(fields) == 6 and (path := Path(fields[5].strip())).parent == SHM:
                segments.add(path)
        yield session, segments


def session_shm(session: int, proc: Path = Path("/proc")) -> set[Path]:
    """The shared-memory segments the processes of ``session`` map. A vLLM instance stopped (or
    killed) leaves some behind: its tensor-parallel ranks' ``vllm_dist_*cpushm*`` (8 MiB a rank) and
    its engine's ``psm_*`` queues and ``sem.mp-*`` semaphores. The launcher notes them once the
    instance is ready and removes them after it stops (:func:`remove_unmapped`)."""
    return {p for s, segments in _shm_maps(proc) if s == session for p in segments}


def session_alive(session: int, proc: Path = Path("/proc")) -> bool:
    """Whether a process of ``session`` still runs (a zombie does not count)."""
    return any(s == session and state != "Z" for _, state, s in _sessions(proc))


def remove_unmapped(paths: set[Path], proc: Path = Path("/proc")) -> set[Path]:
    """Remove those of ``paths`` that no process maps now (another user's stay); the ones removed."""
    if not paths:
        return set()
    in_use = {p for _, segments in _shm_maps(proc) for p in segments}
    removed: set[Path] = set()
    for path in paths - in_use:
        with contextlib.suppress(FileNotFoundError, PermissionError):
            path.unlink()
            removed.add(path)
    return removed


def _remove_shm(inst: Instance) -> None:
    """After ``inst``'s session is gone (or 5 s), remove the segments it left."""
    if inst.proc is not None:
        deadline = time.monotonic() + 5.0
        while session_alive(inst.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    remove_unmapped(inst.shm)
    inst.shm.clear()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> int:
    """How many NUMA nodes this host has (1 where the kernel does not say)."""
    return max(1, sum(1 for p in root.glob("node[0-9]*") if p.name[4:].isdigit()))


class VllmInstances:
    """The running instances of one plan: started, waited for, restarted when they exit."""

    def __init__(self, plan: list[InstanceSpec], *, dtype: str, max_model_len: int, capacity_bytes: int,
                 family: str, kv_cache_bytes: int = 1 << 30, tensor_parallel: int = 1, log_dir: Path | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be at least 1, got {tensor_parallel}")
        self.store = StoreConfig(shm_dir() / f"agentshare-kv-{uuid.uuid4().hex[:12]}", capacity_bytes, family)
        self.log_dir = log_dir or Path(tempfile.gettempdir()) / f"{self.store.root.name}-logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        # the connector is imported by vLLM's processes: they must find this package
        root = str(Path(__file__).resolve().parents[2])
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (root, self.env.get("PYTHONPATH", "")) if p)
        if tensor_parallel > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in self.env \
                and (nodes := numa_nodes()) < tensor_parallel:
            self._share_cores(tensor_parallel, nodes)
        self.instances = {
            s.name: Instance(s, port := free_port(), command(s, port=port, dtype=dtype, store=self.store,
                                                             max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                                                             tensor_parallel=tensor_parallel))
            for s in plan
        }
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._supervisor: threading.Thread | None = None

    def _share_cores(self, ranks: int, nodes: int) -> None:
        """vllm-cpu binds each rank to a NUMA node of its own and refuses to start with fewer nodes
        than ranks: unbound, the ranks share the instance's thread budget (``OMP_NUM_THREADS``,
        else the physical cores), split evenly, since each would otherwise start that many threads
        and oversubscribe the cores (a two-rank test here: 130 s at 2 threads a rank, 27 s at 1).
        Both variables are ignored on GPUs."""
        from server.engine.numerics import choose_threads

        budget = choose_threads(None, self.env).threads
        per_rank = max(1, budget // ranks)
        self.env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        self.env["OMP_NUM_THREADS"] = str(per_rank)
        log.info("%d NUMA node(s) for %d tensor-parallel ranks: VLLM_CPU_OMP_THREADS_BIND=nobind, "
                 "OMP_NUM_THREADS=%d a rank (of %d)", nodes, ranks, per_rank, budget)

    def __getitem__(self, name: str) -> Instance:
        return self.instances[name]

    def _start(self, inst: Instance) -> None:
        inst.log_file = open(self.log_dir / f"{inst.spec.name}.log", "ab")
        # a session of its own: stopping the instance stops vLLM's engine processes with it
        inst.proc = subprocess.Popen(inst.args, env=self.env, stdout=inst.log_file, stderr=subprocess.STDOUT,
                                     preexec_fn=die_with_parent, start_new_session=True)
        inst.starts += 1
        inst.ready = False
        log.info("vllm instance", extra={"event": "vllm_start", "instance": inst.spec.name, "port": inst.port,
                                         "pid": inst.proc.pid, "log": str(self.log_dir / f"{inst.spec.name}.log")})

    def start(self, *, timeout: float = 600.0) -> None:
        """Start every instance and wait until all answer ``/health``; then supervise them."""
        log.info("store", extra={"event": "vllm_store", "root": str(self.store.root),
                                 "capacity_bytes": self.store.capacity_bytes})
        for inst in self.instances.values():
            self._start(inst)
        deadline = time.monotonic() + timeout
        for inst in self.instances.values():
            self._wait_ready(inst, deadline)
        self._supervisor = threading.Thread(target=self._supervise, name="vllm-supervisor", daemon=True)
        self._supervisor.start()

    def _wait_ready(self, inst: Instance, deadline: float) -> None:
        assert inst.proc is not None
        wait_ready(inst.proc, inst.url + "/health", deadline=deadline, what=f"vLLM instance {inst.spec.name}",
                   hint=f"; see {self.log_dir / (inst.spec.name + '.log')}", poll=1.0)
        inst.ready = True
        inst.shm |= session_shm(inst.proc.pid)

    def _supervise(self) -> None:
        backoff: dict[str, float] = {}
        while not self._closed.wait(1.0):
            for inst in self.instances.values():
                if inst.proc is None or inst.proc.poll() is None:
                    if not inst.ready and inst.proc is not None:
                        try:
                            inst.ready = httpx.get(inst.url + "/health", timeout=1).status_code == 200
                        except httpx.HTTPError:
                            pass
                        if inst.ready:
                            inst.shm |= session_shm(inst.proc.pid)
                            log.info("vllm instance ready", extra={"event": "vllm_ready", "instance": inst.spec.name})
                    continue
                inst.ready = False
                _signal_group(inst.proc, signal.SIGKILL)  # its engine processes, if any outlived it
                _remove_shm(inst)
                wait = backoff.get(inst.spec.name, 1.0)
                log.warning("vllm instance exited", extra={"event": "vllm_exit", "instance": inst.spec.name,
                                                           "code": inst.proc.returncode, "restart_in_s": wait})
                if self._closed.wait(wait):
                    return
                backoff[inst.spec.name] = min(wait * 2, 60.0)
                with self._lock:
                    if not self._closed.is_set():
                        self._start(inst)

    def down(self) -> list[str]:
        """Instances not serving now (starting, restarting, or exited)."""
        return [n for n, i in self.instances.items() if not i.ready]

    def close(self) -> None:
        with self._lock:
            self._closed.set()
        for inst in self.instances.values():
            if inst.proc is not None:
                _signal_group(inst.proc, signal.SIGTERM)
        for inst in self.instances.values():
            if inst.proc is not None:
                try:
                    inst.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
                _signal_group(inst.proc, signal.SIGKILL)  # vLLM's engine processes, whatever is left
                inst.proc.wait()
                _remove_shm(inst)
            if inst.log_file is not None:
                inst.log_file.close()
        shutil.rmtree(self.store.root, ignore_errors=True)
