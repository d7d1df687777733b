"""Start a cluster's processes: a worker, the router, or a whole local set.

::

    agentshare serve --disaggregated --prefill-workers 1 --decode-workers 2 --module coder=...
        └─ LocalCluster: one `agentshare worker` process per worker, each told its threads
           (and, when there are cores enough, its own cores); the router runs in this process
    agentshare worker --role decode --port 8101 --module coder=... --cluster-secret-file S [--join URL]
    agentshare router --worker http://host-a:8101 --worker http://host-b:8102 --cluster-secret-file S

Threads: ``cores // workers`` each (at least one), so the processes never oversubscribe the
cores with OpenMP threads that spin against each other.

Security: the workers a launcher starts listen on ``worker_host`` (127.0.0.1 unless asked),
whatever address the router serves on, and get a cluster secret made for them
(``ClusterSecret.generate()``) through their environment, never their command line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from server import positions, tracing
from server.api.config import ServerConfig
from server.cluster.auth import ClusterSecret
from server.cluster.messages import Role
from server.cluster.router import RouterConfig
from server.process import die_with_parent, free_port, wait_ready

log = logging.getLogger("agentshare.cluster")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """One worker process to start."""

    role: Role
    modules: Mapping[str, Path] = field(default_factory=dict)
    threads: int = 1
    cpus: tuple[int, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = 0  # 0: a free port
    device: str | None = None  # --device of the worker (None: the launcher's own)
    memory_share: float = 1.0  # of the memory utilization: workers sharing one device split it
    keep_hidden: tuple[int, ...] = ()  # a prefill worker: layers whose input it keeps and sends (layer split)


def parse_devices(text: str | None, option: str) -> tuple[str, ...]:
    """``"1,2"`` -> ``("1", "2")``: CUDA device indices for one role (``--decode-devices``).

    >>> parse_devices("0", "--prefill-devices"), parse_devices(None, "--decode-devices")
    (('0',), ())
    >>> parse_devices("1,x", "--decode-devices")
    Traceback (most recent call last):
    ...
    ValueError: --decode-devices takes CUDA device indices separated by commas (e.g. 1,2), got '1,x'
    """
    if not text:
        return ()
    parts = tuple(p.strip() for p in text.split(","))
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"{option} takes CUDA device indices separated by commas (e.g. 1,2), got {text!r}")
    return parts


def plan_workers(
    prefill: int, decode: int, modules: Mapping[str, Path], *, threads: int | None = None, cores: int | None = None,
    prefill_devices: Sequence[str] = (), decode_devices: Sequence[str] = (), keep_hidden: tuple[int, ...] = (),
) -> list[WorkerSpec]:
    """Prefill workers, then decode workers with the agents' modules dealt round-robin (every
    decode worker also serves the base). Threads and cores are shared out without overlap.
    Prefill workers keep the hidden state of ``keep_hidden`` (see :func:`split_depths`).

    Devices: a role given CUDA device indices deals them round-robin to its workers; each worker
    sees only its own device (``CUDA_VISIBLE_DEVICES``) and runs on it as ``cuda``. Workers that
    share a device split its memory share between them.

    Examples:
        >>> specs = plan_workers(1, 2, {"a": Path("/a"), "b": Path("/b"), "c": Path("/c")}, cores=2)
        >>> [(s.role, sorted(s.modules), s.threads) for s in specs]
        [('prefill', [], 1), ('decode', ['a', 'c'], 1), ('decode', ['b'], 1)]
        >>> specs = plan_workers(1, 3, {}, cores=4, prefill_devices=["0"], decode_devices=["1", "2"])
        >>> [(s.env.get("CUDA_VISIBLE_DEVICES"), s.device, s.memory_share) for s in specs]
        [('0', 'cuda', 1.0), ('1', 'cuda', 0.5), ('2', 'cuda', 1.0), ('1', 'cuda', 0.5)]
    """
    if prefill < 0 or decode < 1:
        raise ValueError("a cluster needs at least one decode worker and no negative counts")
    if prefill_devices and not prefill:
        raise ValueError("--prefill-devices needs prefill workers (--prefill-workers 1 or more)")
    cores = cores or len(os.sched_getaffinity(0))
    n = prefill + decode
    each = threads or max(1, cores // n)
    own_cores = each * n <= cores  # pin each process to its own cores when they fit
    specs: list[WorkerSpec] = []
    names = list(modules)
    for i in range(n):
        role: Role = "prefill" if i < prefill else "decode"
        mods = {m: modules[m] for j, m in enumerate(names) if role == "decode" and j % decode == i - prefill}
        cpus = tuple(range(i * each, (i + 1) * each)) if own_cores else ()
        devices = prefill_devices if role == "prefill" else decode_devices
        index = i if role == "prefill" else i - prefill
        if devices:
            visible = devices[index % len(devices)]
            specs.append(WorkerSpec(role=role, modules=mods, threads=each, cpus=cpus, device="cuda",
                                    env={"CUDA_VISIBLE_DEVICES": visible}))
        else:
            specs.append(WorkerSpec(role=role, modules=mods, threads=each, cpus=cpus))
        if role == "prefill":
            specs[-1] = replace(specs[-1], keep_hidden=keep_hidden)
    sharing: dict[str | None, int] = {}
    for s in specs:
        sharing[s.env.get("CUDA_VISIBLE_DEVICES")] = sharing.get(s.env.get("CUDA_VISIBLE_DEVICES"), 0) + 1
    return [replace(s, memory_share=1.0 / sharing[s.env.get("CUDA_VISIBLE_DEVICES")]) for s in specs]


def split_depths(modules: Mapping[str, Path], model_dir: Path | None) -> tuple[int, ...]:
    """The layers layer-split modules start their own computation at (``recompute_layers`` in
    their manifests): where a prefill worker keeps the base's hidden state for them."""
    from transformers import AutoConfig

    from server.models.patch import resolve_model_dir
    from server.modules.manifest import Manifest

    ks = {m.recompute_layers for m in map(Manifest.read, modules.values()) if m is not None and m.recompute_layers}
    if not ks:
        return ()
    layers = int(AutoConfig.from_pretrained(resolve_model_dir(model_dir)).num_hidden_layers)
    splits = {positions.split_layer(positions.Facts(shares_prefill=True, recompute_layers=k), layers) for k in ks}
    return tuple(sorted(s for s in splits if s > 0))  # k = L: a private prefill, nothing to keep


@dataclass(slots=True)
class _Process:
    spec: WorkerSpec
    url: str
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None


class LocalCluster:
    """Worker processes on this host, listening on ``config.host``.
    ``with LocalCluster(...) as cluster: cluster.urls``; ``cluster.secret`` is theirs (made
    here unless given)."""

    def __init__(
        self, specs: Sequence[WorkerSpec], config: ServerConfig, *, chunk_blocks: int = 32,
        log_dir: Path | None = None, join: str | None = None, secret: ClusterSecret | None = None,
    ) -> None:
        self.config, self.log_dir = config, log_dir
        self.secret = secret or ClusterSecret.generate()
        self._procs: list[_Process] = []
        for spec in specs:
            port = spec.port or free_port(config.host)
            url = f"http://{config.host}:{port}"
            args = [sys.executable, "-m", "server.cli", "worker", "--role", spec.role, "--host", config.host,
                    "--port", str(port), "--dtype", config.dtype, "--threads", str(spec.threads),
                    "--device", spec.device or config.device,
                    "--gpu-memory-utilization", f"{config.memory_utilization * spec.memory_share:.4f}",
                    "--kv-cache", str(config.kv_cache_bytes or "auto"), "--chunk-blocks", str(chunk_blocks),
                    "--max-step-tokens", str(config.max_step_tokens), "--log-level", config.log_level]
            if config.model_dir is not None:
                args += ["--model", str(config.model_dir)]
            for name, path in spec.modules.items():
                args += ["--module", f"{name}={path}"]
            if spec.cpus:
                args += ["--cpus", ",".join(map(str, spec.cpus))]
            if spec.keep_hidden:
                args += ["--keep-hidden-layers", ",".join(map(str, spec.keep_hidden))]
            if join:
                args += ["--join", join]
            self._procs.append(_Process(spec, url, args))

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self._procs]

    def start(self) -> None:
        for i in range(len(self._procs)):
            self.restart(i)

    def restart(self, index: int, *, env: Mapping[str, str] | None = None) -> None:
        """(Re)start worker ``index`` on its port: a worker that comes back rejoins the router.
        ``env`` replaces the spec's extra environment from now on."""
        p = self._procs[index]
        if p.proc is not None and p.proc.poll() is None:
            raise RuntimeError(f"worker {index} ({p.url}) is still running")
        if env is not None:  # the device a worker was given stays its own
            kept = {k: v for k, v in p.spec.env.items() if k == "CUDA_VISIBLE_DEVICES"}
            p.spec = replace(p.spec, env={**kept, **env})
        if p.log is not None:
            p.log.close()
        environ = {**os.environ, "OMP_NUM_THREADS": str(p.spec.threads), **p.spec.env, **self.secret.env()}
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            p.log = open(self.log_dir / f"worker-{index}-{p.spec.role}.log", "ab")  # closed in stop
        p.proc = subprocess.Popen(p.args, env=environ, stdout=p.log, stderr=subprocess.STDOUT if p.log else None,
                                  preexec_fn=die_with_parent)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        for i, p in enumerate(self._procs):
            assert p.proc is not None
            wait_ready(p.proc, f"{p.url}/internal/info", deadline=deadline, what=f"worker {i} ({p.spec.role})",
                       hint=f"; see {self.log_dir}" if self.log_dir else "", headers=self.secret.headers())

    def kill(self, index: int) -> None:
        """Kill worker ``index`` hard (SIGKILL), as a crash would."""
        p = self._procs[index]
        if p.proc is not None and p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(timeout=30)

    def returncode(self, index: int) -> int | None:
        p = self._procs[index].proc
        return None if p is None else p.poll()

    def stop(self) -> None:
        for p in self._procs:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in self._procs:
            if p.proc is not None:
                try:
                    p.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.proc.kill()
                    p.proc.wait()
            if p.log is not None:
                p.log.close()

    def __enter__(self) -> LocalCluster:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- process entry points ---------------------------------------------------------------------


def serve_worker(
    config: ServerConfig, *, role: Role, secret: ClusterSecret, chunk_blocks: int = 32, cpus: Sequence[int] = (),
    join: str | None = None, kv_port: int = 0, advertise: str | None = None,
) -> None:
    """Run one worker until interrupted (blocks)."""
    import uvicorn

    from server.api.app import create_app
    from server.api.logs import configure_logging
    from server.cluster.worker import FaultPlan, Worker
    from server.engine.build import start_engine

    configure_logging(config.log_level)
    tracing.configure(f"agentshare-{role}")  # AGENTSHARE_OTEL / AGENTSHARE_TRACE_FILE, inherited from a launcher
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    modules = config.modules if role == "decode" else {}
    if role == "prefill" and config.modules:
        raise ValueError("a prefill worker runs the base model only; give --module to decode workers")
    engine = start_engine(config.model_dir, modules=modules, dtype=config.dtype, threads=config.threads,
                          config=config.engine_config(), base_name=config.base_name, device=config.device)
    core = engine.core
    url = advertise or f"http://{config.host}:{config.port}"
    worker = Worker(engine, role=role, url=url, threads=config.threads or 1, secret=secret, kv_host=config.host,
                    kv_port=kv_port,
                    chunk_blocks=chunk_blocks, faults=FaultPlan.parse(os.environ.get("AGENTSHARE_FAULT")),
                    join=join)
    log.info("worker", extra={"event": "worker", "role": role, "url": url, "agents": ",".join(core.modules),
                              "threads": config.threads, "cpus": ",".join(map(str, cpus))})
    app = create_app(engine, config, owns_engine=True, plugins=[worker])
    uvicorn.run(app, host=config.host, port=config.port, log_config=None, access_log=False,
                log_level=config.log_level.lower(), timeout_graceful_shutdown=5)


def serve_router(
    config: ServerConfig, workers: Sequence[str], router: RouterConfig = RouterConfig(), *, secret: ClusterSecret,
    admin_key: str | None = None,
) -> None:
    """Run the router (the public API) over running workers until interrupted (blocks)."""
    import uvicorn
    from transformers import AutoTokenizer

    from server.api.app import create_app
    from server.api.logs import configure_logging
    from server.cluster.router import ClusterBackend
    from server.models.patch import resolve_model_dir

    configure_logging(config.log_level)
    tracing.configure("agentshare-router")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(config.model_dir))
    backend = ClusterBackend.connect([w.rstrip("/") for w in workers], tokenizer, router, secret=secret,
                                     admin_key=admin_key)
    log.info("router", extra={"event": "router", "workers": ",".join(workers), "agents": ",".join(backend.facts.agents),
                              "codec": router.codec, "transport": router.transport,
                              "placement_policy": router.placement_policy,
                              "threshold": router.policy.threshold_tokens})
    app = create_app(backend, config, owns_engine=True, plugins=[backend])
    uvicorn.run(app, host=config.host, port=config.port, log_config=None, access_log=False,
                log_level=config.log_level.lower(), timeout_graceful_shutdown=5)


def serve_disaggregated(
    config: ServerConfig, *, prefill: int, decode: int, router: RouterConfig = RouterConfig(),
    threads: int | None = None, chunk_blocks: int = 32, worker_host: str = "127.0.0.1", admin_key: str | None = None,
    prefill_devices: Sequence[str] = (), decode_devices: Sequence[str] = (),
) -> None:
    """``agentshare serve --disaggregated``: start the workers here (on ``worker_host``, with a
    secret made for them), then serve the router (on ``config.host``)."""
    from server.api.logs import configure_logging

    configure_logging(config.log_level)
    specs = plan_workers(prefill, decode, config.modules, threads=threads, prefill_devices=prefill_devices,
                         decode_devices=decode_devices, keep_hidden=split_depths(config.modules, config.model_dir))
    for i, s in enumerate(specs):
        log.info("plan", extra={"event": "plan", "worker": i, "role": s.role, "agents": ",".join(s.modules) or "base",
                                "keep_hidden": ",".join(map(str, s.keep_hidden)) or "none",
                                "threads": s.threads, "cpus": ",".join(map(str, s.cpus)) or "shared",
                                "device": s.device or config.device,
                                "cuda_visible_devices": s.env.get("CUDA_VISIBLE_DEVICES", "all")})
    worker_config = replace(config, modules={}, threads=None, host=worker_host)
    cluster = LocalCluster(specs, worker_config, chunk_blocks=chunk_blocks)
    # uvicorn re-raises the SIGTERM it caught once it has shut down; with the default handler
    # that kills this process before the workers are stopped. Exit through Python instead.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with cluster, _router_threads(1):
        serve_router(config, cluster.urls, router, secret=cluster.secret, admin_key=admin_key)


@contextlib.contextmanager
def _router_threads(n: int) -> Iterator[None]:
    """The router computes nothing heavy: keep its torch (imported by the API) off the workers' cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
