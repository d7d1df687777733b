"""The ``agentshare`` command line.

    agentshare --help
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from server.policy import placement

if TYPE_CHECKING:  # imported where used: the commands load only what they run
    from server.cluster.auth import ClusterSecret
    from server.cluster.router import RouterConfig

app = typer.Typer(
    name="agentshare",
    help="Serve multi-agent teams that share one prefill; fine-tune decode modules.",
    no_args_is_help=True,
    add_completion=False,
)


_SECRET_ENV, _ADMIN_ENV = "AGENTSHARE_CLUSTER_SECRET", "AGENTSHARE_ADMIN_KEY"  # server.cluster.auth's
MODEL_HELP = ("base model directory, or a base patch (a joint base's few MB: built once in the cache); "
              "default: SmolLM2-135M-Instruct")
_SECRET_HELP = (f"file (mode 0600) holding the cluster secret (`agentshare cluster-secret PATH` makes one), or "
                f"{_SECRET_ENV}; a launched set gets one from its launcher")


def _registered(registry: str, option: str) -> Callable[[str], str]:
    """A parser: the value if the registry module ``registry`` has it (``get(name)``), else a usage
    error listing the registered names. Imported only then: the CLI itself starts without torch."""

    def parse(value: str) -> str:
        try:
            importlib.import_module(registry).get(value)
        except ValueError as exc:  # UnknownCodec, UnknownPolicy
            raise typer.BadParameter(str(exc), param_hint=option) from None
        return value

    return parse


def _input_errors() -> dict[type[Exception], str | None]:
    """The errors that mean a model or module the user named cannot be served, each with what to
    do. Imported when one is raised: the CLI itself starts without torch."""
    from server.engine.rope import UnsupportedRopeError
    from server.engine.weights import UnsupportedModelError
    from server.models.loader import ModelLoadError
    from server.modules.manifest import ManifestError
    from server.modules.registry import ModuleLoadError

    model = "--model takes a base model directory or a base patch; leave it out for the default model"
    module = "--module takes NAME=PATH, PATH a module `agentshare finetune` wrote for this base"
    return {ModelLoadError: model, UnsupportedModelError: model, UnsupportedRopeError: model,
            ModuleLoadError: module, ManifestError: module}


@contextlib.contextmanager
def _refusing_bad_input(
    command: str, errors: Callable[[], Mapping[type[Exception], str | None]] = _input_errors,
) -> Iterator[None]:
    """Input the user can fix (a model or module that cannot be served; for the fine-tuning
    commands, their data and options): one line on stderr (what is wrong, and what to do where
    ``errors`` gives a hint) and exit status 2, as for a usage error, instead of a traceback; the
    line is never wrapped, so a launcher that shows the server's last words (the SDK's) shows the
    whole path. ``errors`` is called only when something is raised."""
    try:
        yield
    except Exception as exc:
        kinds = errors()
        kind = next((k for k in kinds if isinstance(exc, k)), None)
        if kind is None:
            raise
        hint = kinds[kind]
        typer.echo(f"agentshare {command}: {exc}" + (f" ({hint})" if hint else ""), err=True)
        raise typer.Exit(2) from None


_DEVICE_HELP = "auto (the first CUDA device this process sees, else the CPU), cpu, cuda or cuda:N; logged at start"
_KV_HELP = ("KV pool size, e.g. 512MiB, 2GiB; auto: 1GiB on the CPU, on a CUDA device what "
            "--gpu-memory-utilization leaves after the weights")
_UTIL_HELP = "with --kv-cache auto on a CUDA device: the fraction of its memory this server may hold (weights and KV)"

_CODEC = _registered("server.cluster.codecs", "--transfer-codec")
_PLACEMENT = _registered("server.policy.placement", "--placement-policy")
_POLICIES = "[" + "|".join(placement.names()) + "]"


@app.callback()
def main() -> None:
    """agentshare: one prefill of a shared context, many decode modules."""


@app.command()
def finetune(
    data: Annotated[Path, typer.Argument(help="JSONL rows: context, instruction, response")],
    output: Annotated[Path, typer.Option("--output", "-o", help="module directory to write")],
    name: Annotated[str, typer.Option(help="module name (letters, digits, . _ -)")],
    base: Annotated[Path | None, typer.Option(help=MODEL_HELP)] = None,
    kind: str = typer.Option("lora", help="lora or full"),
    rank: int = typer.Option(16), alpha: float = typer.Option(32.0),
    target: Annotated[list[str] | None, typer.Option(help="LoRA target module (repeat); default: all projections")] = None,
    placement: str = typer.Option("turn", help="invocation point: turn or header"),
    epochs: float = typer.Option(1.0), batch_size: int = typer.Option(8),
    lr: float | None = typer.Option(None, help="default 1e-3 (lora), 5e-5 (full)"),
    max_length: int = typer.Option(2048), seed: int = typer.Option(0),
    kv_dtype: str = typer.Option("bfloat16", help="KV dtype the server will use (part of the family)"),
    family: str | None = typer.Option(None, help="refuse a base not of this family digest"),
    bf16: bool = typer.Option(False, help="bf16 autocast matmuls (faster on CPUs with AMX, and on GPUs)"),
    checkpoint_every: int = typer.Option(50), threads: int | None = typer.Option(None),
    device: str = typer.Option("auto", help=_DEVICE_HELP),
    standard: bool = typer.Option(False, help="train on the module's own prefill (no sharing, no manifest)"),
    layers: int = typer.Option(0, help="tune only the top N layers; the ones below stay the base's (0: all)"),
    recompute: int = typer.Option(0, help="the module recomputes the shared prefix's KV of its top K layers "
                                          "from the base's hidden state (the layer split; 0: none)"),
    fidelity: float | None = typer.Option(
        None, metavar="POINTS", help="hold out rows, train the own-prefill comparator too, and pick the smallest "
        "layer split whose held-out accuracy is within POINTS of it; the figures go into the manifest"),
    fidelity_held_out: float = typer.Option(0.2, help="with --fidelity: rows held out (a fraction < 1, or a count)"),
    fidelity_step: int = typer.Option(1, help="with --fidelity: resolution of the layer-split search, in layers"),
) -> None:
    """Fine-tune a decode module on the base model's KV (cache-conditioned); write it with its manifest.

    With --fidelity POINTS it also measures what sharing costs the module on held-out rows and
    chooses the layer split (see docs/finetune.md)."""
    from server.training.command import finetune_errors, run_finetune

    options = dict(locals())
    with _refusing_bad_input("finetune", finetune_errors):
        run_finetune(options)


@app.command("finetune-joint")
def finetune_joint(
    data: Annotated[Path, typer.Argument(help="JSONL rows of every task of the family, each naming its 'task'")],
    output: Annotated[Path, typer.Option("--output", "-o", help="directory of the new base model to write")],
    base: Annotated[Path | None, typer.Option(help=MODEL_HELP)] = None,
    rank: int = typer.Option(16, help="rank of the shared prefill adapter"), alpha: float = typer.Option(32.0),
    decode_rank: int = typer.Option(8, help="rank of each task's decode adapter during this stage"),
    epochs: float = typer.Option(1.0), batch_size: int = typer.Option(8), lr: float = typer.Option(1e-3),
    seed: int = typer.Option(0), kv_dtype: str = typer.Option("bfloat16", help="KV dtype of the new family"),
    bf16: bool = typer.Option(False, help="bf16 autocast matmuls"), threads: int | None = typer.Option(None),
    device: str = typer.Option("auto", help=_DEVICE_HELP),
) -> None:
    """Train the family's prefill module jointly with a decode adapter per task, merge it into a new
    base (a new family); then fine-tune each decode module on it with `agentshare finetune --base`."""
    from server.training.command import finetune_joint_errors, run_finetune_joint

    options = dict(locals())
    with _refusing_bad_input("finetune-joint", finetune_joint_errors):
        run_finetune_joint(options)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000),
    model: Path | None = typer.Option(None, envvar="AGENTSHARE_MODEL",
                                      help=MODEL_HELP),
    module: list[str] | None = typer.Option(None, help="agent as NAME=PATH to a decode module (repeat)"),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16"),
    threads: int | None = typer.Option(None, help="torch threads (default: OMP_NUM_THREADS, else the physical cores this process may use; logged at start)"),
    device: str = typer.Option("auto", help=_DEVICE_HELP),
    kv_cache: str = typer.Option("auto", help=_KV_HELP),
    gpu_memory_utilization: float = typer.Option(0.9, help=_UTIL_HELP),
    max_running: int = typer.Option(64, help="requests decoding together"),
    queue_limit: int = typer.Option(1024, help="requests waiting; beyond it: 429"),
    step_timeout: float = typer.Option(60.0, help="seconds an engine step may run before its requests fail "
                                       "and /health says degraded"),
    api_key: list[str] | None = typer.Option(
        None, envvar="AGENTSHARE_API_KEYS", help="accepted API key, one tenant each (repeat; or the env var, "
        "space-separated); none: no auth"),
    log_level: str = typer.Option("info"),
    context_ttl: float = typer.Option(600.0, help="default TTL of a pinned shared context, seconds"),
    max_pinned_contexts: int = typer.Option(64, help="per tenant: shared contexts pinned at once; beyond: 429"),
    max_pinned_share: float | None = typer.Option(
        None, help="per tenant: fraction of the KV pool its pinned contexts may hold; beyond: 429 "
        "(default: 1 with one tenant, 0.5 with several API keys)"),
    disaggregated: bool = typer.Option(False, help="run prefill and decode in worker processes, this one routes"),
    prefill_workers: int = typer.Option(1, help="with --disaggregated: prefill worker processes"),
    decode_workers: int = typer.Option(2, help="with --disaggregated: decode worker processes (agents dealt round-robin)"),
    prefill_devices: str | None = typer.Option(None, help="with --disaggregated: CUDA device indices of the prefill "
                                               "workers, e.g. 0 (dealt round-robin; each worker sees its own only)"),
    decode_devices: str | None = typer.Option(None, help="with --disaggregated: CUDA device indices of the decode "
                                              "workers, e.g. 1,2"),
    transfer_codec: str = typer.Option("bf16", parser=_CODEC, metavar="CODEC", help="with --disaggregated: KV payload codec, "
                                       "a name registered in server/cluster/codecs (built in: fp32, bf16, "
                                       "int8; int8 puts moved blocks in the lossy namespace)"),
    transport: str = typer.Option("auto", help="with --disaggregated: shm, tcp, or auto (shm within a host)"),
    placement_policy: str = typer.Option("offload", parser=_PLACEMENT, metavar=_POLICIES, help="with --disaggregated, or "
                                         "--engine vllm with --node: the placement policy (registered in "
                                         "server/policy/placement.py)"),
    offload_threshold: int = typer.Option(256, help="with --disaggregated: offload prefills longer than this (tokens)"),
    bandwidth_aware: bool = typer.Option(True, help="with --disaggregated: keep a prefill local when moving its KV "
                                         "would take longer than computing it (off: offload every long prefill)"),
    worker_host: str = typer.Option("127.0.0.1", help="with --disaggregated: address the workers listen on, "
                                    "whatever --host is (0.0.0.0 only on a private network: docs/cluster.md)"),
    admin_key_file: Path | None = typer.Option(None, help=f"with --disaggregated: file (mode 0600) of the key "
                                               f"/internal/cluster asks for (or {_ADMIN_ENV})"),
    otel: bool = typer.Option(False, "--otel", help="trace requests with OpenTelemetry (the otel extra; also "
                              "AGENTSHARE_OTEL=1; AGENTSHARE_TRACE_FILE=path writes spans as JSON lines)"),
    engine: str = typer.Option("torch", help="torch (the embedded engine) or vllm (vLLM instances sharing one "
                               "base prefill through agentshare's KV connector; the vllm extra)"),
    kv_store: str = typer.Option("2GiB", help="with --engine vllm: shared-memory store of prefix KV"),
    lora_instances: int = typer.Option(1, help="with --engine vllm: vLLM instances the LoRA modules are dealt to"),
    enforce_eager: bool = typer.Option(False, help="with --engine vllm: compile nothing (starts faster, runs slower)"),
    tensor_parallel_size: int = typer.Option(1, min=1, help="with --engine vllm: ranks of every vLLM instance "
                                             "(vLLM's --tensor-parallel-size; each rank stores its KV heads)"),
    node: list[str] | None = typer.Option(None, help="with --engine vllm: URL of an `agentshare vllm-node` on another "
                                          "host whose agents this server also serves (repeat)"),
    cluster_secret_file: Path | None = typer.Option(None, help="with --node: " + _SECRET_HELP),
) -> None:
    """Serve the OpenAI-compatible and native API; every agent of the family shares prefill."""
    _otel(otel)
    from server.api.serve import config_from_options, parse_bytes
    from server.api.serve import serve as run_server

    opts = locals()
    config = config_from_options(opts)
    if engine not in ("torch", "vllm"):
        raise typer.BadParameter("--engine is torch or vllm")
    if engine == "vllm":
        if disaggregated:
            raise typer.BadParameter("--engine vllm is disaggregated already (a base instance and decode "
                                     "instances); leave out --disaggregated")
        secret = _secret(cluster_secret_file) if node else None
        _require_vllm("--engine vllm")
        from server.vllm.serve import PlanError, VllmOptions, serve_vllm

        try:
            with _refusing_bad_input("serve"):
                serve_vllm(config, VllmOptions(store_bytes=parse_bytes(kv_store), lora_instances=lora_instances,
                                               enforce_eager=enforce_eager, placement_policy=placement_policy,
                                               tensor_parallel=tensor_parallel_size),
                           nodes=node or (), secret=secret)
        except PlanError as exc:
            raise typer.BadParameter(str(exc)) from None
        return
    if node:
        raise typer.BadParameter("--node needs --engine vllm")
    if tensor_parallel_size > 1:
        raise typer.BadParameter("--tensor-parallel-size needs --engine vllm (the torch engine runs each worker "
                                 "on one device: give --disaggregated workers devices of their own)")
    _check_device(device)
    if not disaggregated:
        if prefill_devices or decode_devices:
            raise typer.BadParameter("--prefill-devices and --decode-devices need --disaggregated; one server "
                                     "runs on --device")
        with _refusing_bad_input("serve"):
            run_server(config)
        return
    from server.cluster.launch import parse_devices, serve_disaggregated

    try:
        on_prefill = parse_devices(prefill_devices, "--prefill-devices")
        on_decode = parse_devices(decode_devices, "--decode-devices")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    serve_disaggregated(config, prefill=prefill_workers, decode=decode_workers, threads=threads,
                        prefill_devices=on_prefill, decode_devices=on_decode,
                        router=_router_config(transfer_codec, transport, offload_threshold, bandwidth_aware,
                                              placement_policy),
                        worker_host=worker_host, admin_key=_admin_key(admin_key_file))


@app.command()
def worker(
    role: str = typer.Option(..., help="prefill or decode"),
    host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8101),
    model: Path | None = typer.Option(None, help=MODEL_HELP),
    module: list[str] | None = typer.Option(None, help="decode workers: agent as NAME=PATH (repeat)"),
    dtype: str = typer.Option("auto"), threads: int | None = typer.Option(None),
    cpus: str | None = typer.Option(None, help="cores to run on, e.g. 0,1"),
    device: str = typer.Option("auto", help=_DEVICE_HELP),
    kv_cache: str = typer.Option("auto", help=_KV_HELP), max_step_tokens: int = typer.Option(512),
    gpu_memory_utilization: float = typer.Option(0.9, help=_UTIL_HELP),
    chunk_blocks: int = typer.Option(32, help="KV blocks per transferred chunk"),
    keep_hidden_layers: str | None = typer.Option(
        None, help="prefill workers: layers whose input to keep and send with the KV, e.g. 8,15 (the splits "
                   "of the decode workers' layer-split agents, so they fill from the blocks; serve "
                   "--disaggregated sets it)"),
    kv_port: int = typer.Option(0, help="decode workers: port of the KV receiver (0: any)"),
    join: str | None = typer.Option(None, help="router URL to join (a worker on another host)"),
    advertise: str | None = typer.Option(None, help="URL the router reaches this worker at (default: host:port)"),
    cluster_secret_file: Path | None = typer.Option(None, help=_SECRET_HELP),
    log_level: str = typer.Option("info"),
    otel: bool = typer.Option(False, "--otel", help="trace requests with OpenTelemetry (the otel extra; also "
                              "AGENTSHARE_OTEL=1; AGENTSHARE_TRACE_FILE=path writes spans as JSON lines)"),
) -> None:
    """Run one worker of a disaggregated cluster (prefill or decode)."""
    _otel(otel)
    from server.api.serve import config_from_options
    from server.cluster.launch import serve_worker

    if role not in ("prefill", "decode"):
        raise typer.BadParameter("--role is prefill or decode")
    _check_device(device)
    config = config_from_options(locals())
    try:
        keep = tuple(sorted({int(x) for x in keep_hidden_layers.split(",") if x.strip()})) if keep_hidden_layers else ()
    except ValueError:
        raise typer.BadParameter(f"--keep-hidden-layers takes layer numbers like 8,15, got {keep_hidden_layers!r}") from None
    config = type(config)(**{**{f: getattr(config, f) for f in type(config).__dataclass_fields__},
                             "max_step_tokens": max_step_tokens, "keep_hidden": keep})
    secret = _secret(cluster_secret_file)
    with _refusing_bad_input("worker"):
        serve_worker(config, role=role, chunk_blocks=chunk_blocks,  # type: ignore[arg-type]
                     cpus=[int(c) for c in cpus.split(",")] if cpus else (), join=join, kv_port=kv_port,
                     advertise=advertise, secret=secret)


@app.command("vllm-node")
def vllm_node(
    module: Annotated[list[str], typer.Option(help="agent as NAME=PATH to a decode module (repeat)")],
    host: str = typer.Option("127.0.0.1", help="address the API and the KV receiver listen on (0.0.0.0 only on a "
                             "private network: docs/vllm.md)"),
    port: int = typer.Option(8200),
    kv_port: int = typer.Option(0, help="port of the KV receiver (0: any)"),
    advertise: str | None = typer.Option(None, help="host name the frontend reaches the KV receiver at "
                                         "(default: --host)"),
    model: Path | None = typer.Option(None, envvar="AGENTSHARE_MODEL",
                                      help=MODEL_HELP + "; the frontend's"),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16; the frontend's"),
    kv_cache: str = typer.Option("1GiB", help="each instance's vLLM KV cache, e.g. 512MiB"),
    kv_store: str = typer.Option("2GiB", help="shared-memory store of prefix KV"),
    lora_instances: int = typer.Option(1, help="vLLM instances the LoRA modules are dealt to"),
    enforce_eager: bool = typer.Option(False, help="compile nothing (starts faster, runs slower)"),
    tensor_parallel_size: int = typer.Option(1, min=1, help="ranks of every vLLM instance (the frontend's)"),
    cluster_secret_file: Path | None = typer.Option(None, help=_SECRET_HELP),
    log_level: str = typer.Option("info"),
) -> None:
    """Serve agents' vLLM instances on this host for a frontend on another (`serve --engine vllm --node URL`)."""
    from server.api.serve import config_from_options, parse_bytes

    _require_vllm("vllm-node")
    from server.vllm.serve import PlanError, VllmOptions, serve_node

    config, secret = config_from_options(locals()), _secret(cluster_secret_file)
    try:
        with _refusing_bad_input("vllm-node"):
            serve_node(config, VllmOptions(store_bytes=parse_bytes(kv_store), lora_instances=lora_instances,
                                           enforce_eager=enforce_eager, tensor_parallel=tensor_parallel_size),
                       secret=secret, kv_port=kv_port, advertise=advertise)
    except PlanError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command()
def router(
    worker: Annotated[list[str], typer.Option(help="worker URL (repeat); more can join later")],
    host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8000),
    model: Path | None = typer.Option(None, help="base model directory or base patch, for the tokenizer"),
    api_key: list[str] | None = typer.Option(None, envvar="AGENTSHARE_API_KEYS"),
    transfer_codec: str = typer.Option("bf16", parser=_CODEC, metavar="CODEC"), transport: str = typer.Option("auto", help="shm, tcp or auto"),
    placement_policy: str = typer.Option("offload", parser=_PLACEMENT, metavar=_POLICIES),
    offload_threshold: int = typer.Option(256), bandwidth_aware: bool = typer.Option(True),
    max_pinned_contexts: int = typer.Option(64, help="per tenant: shared contexts pinned at once; beyond: 429"),
    max_pinned_share: float | None = typer.Option(
        None, help="per tenant: fraction of the KV pool its pinned contexts may hold; beyond: 429 "
        "(default: 1 with one tenant, 0.5 with several API keys)"),
    cluster_secret_file: Path | None = typer.Option(None, help=_SECRET_HELP),
    admin_key_file: Path | None = typer.Option(None, help=f"file (mode 0600) of the key /internal/cluster asks for "
                                               f"(or {_ADMIN_ENV})"),
    log_level: str = typer.Option("info"),
    otel: bool = typer.Option(False, "--otel", help="trace requests with OpenTelemetry (the otel extra; also "
                              "AGENTSHARE_OTEL=1; AGENTSHARE_TRACE_FILE=path writes spans as JSON lines)"),
) -> None:
    """Serve the API over running workers (started with ``agentshare worker``)."""
    _otel(otel)
    from server.api.serve import config_from_options
    from server.cluster.launch import serve_router

    serve_router(config_from_options(locals()), worker,
                 _router_config(transfer_codec, transport, offload_threshold, bandwidth_aware, placement_policy),
                 secret=_secret(cluster_secret_file), admin_key=_admin_key(admin_key_file))


def _check_device(device: str) -> None:
    """A ``--device`` this process cannot use is a usage error before anything loads."""
    from server.engine.device import resolve_device

    try:
        resolve_device(device)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from None


def _require_vllm(what: str) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise typer.BadParameter(f"{what} needs vLLM: pip install 'agentshare[vllm]' (CPUs) or vllm (GPUs)") from None


def _otel(on: bool) -> None:
    """``--otel``: tracing on here and in the worker processes started from here (their environment)."""
    if on:
        os.environ["AGENTSHARE_OTEL"] = "1"


@app.command()
def kernels(
    fetch: Annotated[bool, typer.Option(help="fetch vLLM's CPU ops where they would serve and are missing")] = True,
) -> None:
    """Fetch vLLM's compiled CPU ops (decode matmul, attention and elementwise kernels) on a CPU that
    runs them (AVX512-BF16), without the vllm package, then say which kernels the engine uses."""
    from server.engine import vllm_attention, vllm_elementwise, vllm_matmul, vllm_ops

    if fetch and vllm_ops.cpu_can_run() and importlib.util.find_spec("vllm") is None:
        try:
            vllm_ops.fetch(progress=typer.echo)
        except RuntimeError as exc:
            typer.echo(f"not fetched: {exc}\nthe engine serves without them (slower decode steps)", err=True)
            raise typer.Exit(1) from None
    for name, status in (("decode linears (vLLM's oneDNN matmul)", vllm_matmul.status()),
                         ("decode attention (vLLM's kernel)", vllm_attention.status()),
                         ("decode elementwise ops (vLLM's)", vllm_elementwise.status())):
        typer.echo(f"{name}: {status}")


@app.command()
def bench(
    url: str = typer.Option("http://127.0.0.1:8000", help="the server's root: an OpenAI-compatible endpoint "
                            "(agentshare in either engine, vLLM, another)"),
    workload: str = typer.Option("react", help="react, reflexion, burst or trace:FILE (a Mooncake-format trace)"),
    agents: str | None = typer.Option(None, help="served model names, comma-separated: the K agents (default: "
                                      "every model /v1/models lists; one model alone stands for 3 agents)"),
    rate: str | None = typer.Option(None, help="open loop: sessions arriving per second (Poisson); a "
                                    "comma-separated list sweeps them"),
    concurrency: str | None = typer.Option(None, help="closed loop: sessions at once (default 2 without "
                                           "--rate); a comma-separated list sweeps them"),
    duration: float = typer.Option(60.0, help="seconds in which sessions start, per load (those started run "
                                   "to their end)"),
    max_sessions: int | None = typer.Option(None, min=1, help="sessions per load, at most"),
    max_requests: int | None = typer.Option(None, min=1, help="requests per load, at most"),
    seed: int = typer.Option(0, help="draws the sessions' texts, lengths and think times, and the arrivals"),
    warmup: int = typer.Option(1, min=0, help="sessions run one by one before each load, not counted"),
    steps: int | None = typer.Option(None, min=1, help="react: steps (3); reflexion: trials (2)"),
    context: str | None = typer.Option(None, help="tokens of each session's context, LOW-HIGH "
                                       "(react, reflexion: 500-1000; burst: 2048)"),
    tool: str = typer.Option("32-96", help="react: tokens of each tool result, LOW-HIGH"),
    think: str = typer.Option("0.5-2", help="seconds between a session's steps, LOW-HIGH"),
    output_tokens: int = typer.Option(32, min=1, help="tokens every request decodes (max_tokens, ignore_eos)"),
    block_tokens: int = typer.Option(16, help="trace: tokens per 512-token hash id (16 or 32)"),
    trace_limit: int | None = typer.Option(None, min=1, help="trace: its first N records only"),
    tokenizer: Path | None = typer.Option(None, help="the served model's tokenizer (a directory), to size the "
                                          "texts (default: SmolLM2-135M-Instruct's)"),
    slo: str | None = typer.Option(None, help="goodput's SLOs in ms, e.g. ttft:2000,tpot:200 (ttft, tpot, e2el)"),
    api_key: str | None = typer.Option(None, envvar="AGENTSHARE_API_KEY", help="sent as a Bearer token"),
    salt_per_agent: bool = typer.Option(False, help="each agent's requests under a cache_salt of its own: "
                                        "sharing off, as vLLM and SGLang key adapters"),
    request_timeout: float = typer.Option(600.0, help="seconds a request may take; beyond, it counts as failed"),
    label: str | None = typer.Option(None, help="the arm's name in the result and the plot (default: the URL)"),
    json_out: Path | None = typer.Option(None, "--json", help="write the result (every figure, the host, the "
                                         "command) to this file"),
    plot: Path | None = typer.Option(None, help="draw p95 TTFT and throughput against the offered rate here "
                                     "(.png, .svg; the bench extra)"),
    progress: bool = typer.Option(True, help="a progress bar per load"),
) -> None:
    """Drive agent sessions against a server at a load or a sweep of loads; report TTFT, TPOT, ITL,
    E2E, sessions, goodput, the cache hit ratio and the server's counters (docs/bench.md)."""
    import asyncio
    import json

    from server.bench import Load, Options
    from server.bench import bench as run_bench
    from server.bench.metrics import parse_slo
    from server.bench.report import jsonable, table
    from server.bench.report import plot as draw
    from server.bench.run import served_models
    from server.bench.text import Corpus
    from server.bench.workloads import make_workload, parse_range

    def numbers(text: str, what: str, kind: type) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(f"{what}: a number or a comma-separated list, got {text!r}") from None

    if rate is not None and concurrency is not None:
        raise typer.BadParameter("give --rate (open loop) or --concurrency (closed loop), not both")
    try:
        loads = ([Load(rate=r) for r in numbers(rate, "--rate", float)] if rate is not None
                 else [Load(concurrency=c) for c in numbers(concurrency or "2", "--concurrency", int)])
        context_range = parse_range(context, "--context") if context else None
        tool_range, think_range = parse_range(tool, "--tool"), parse_range(think, "--think")
        goals = parse_slo(slo)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if not loads:
        raise typer.BadParameter("--rate or --concurrency: give at least one value")
    root = url.rstrip("/")
    try:
        names = ([a.strip() for a in agents.split(",") if a.strip()] if agents
                 else asyncio.run(served_models(root, api_key)))
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if len(names) == 1 and not agents:
        names *= 3
    from transformers import AutoTokenizer

    from server.models.loader import default_model_dir

    tok = AutoTokenizer.from_pretrained(tokenizer or default_model_dir())
    try:
        work = make_workload(workload, Corpus(tok), names, steps=steps, context=context_range,
                             tool=tool_range, think=think_range, output_tokens=output_tokens,
                             block_tokens=block_tokens, limit=trace_limit)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from None
    opts = Options(duration_s=duration, max_sessions=max_sessions, max_requests=max_requests, seed=seed,
                   warmup=warmup, request_timeout_s=request_timeout, api_key=api_key,
                   salt_per_agent=salt_per_agent, progress=progress)
    try:
        result = asyncio.run(run_bench(root, work, loads, opts, slo=goals, label=label,
                                       command=["agentshare", *sys.argv[1:]]))
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{work.name} with agents {', '.join(names)} against {root} on {result['host']['cpu']}")
    typer.echo(table(result))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(jsonable(result), indent=2))
        typer.echo(f"wrote {json_out}")
    if plot is not None:
        try:
            typer.echo(f"wrote {draw({result['label']: result}, plot)}")
        except RuntimeError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None


@app.command("cluster-secret")
def cluster_secret(path: Annotated[Path, typer.Argument(help="file to create (mode 0600; never overwritten)")]) -> None:
    """Write a new cluster secret to PATH: give it to the router and every worker (--cluster-secret-file)."""
    from server.cluster.auth import ClusterSecret

    try:
        ClusterSecret.generate().write(path)
    except OSError as exc:
        raise typer.BadParameter(f"cannot create {path}: {exc.strerror or exc}", param_hint="PATH") from exc
    typer.echo(f"wrote a cluster secret to {path} (mode 0600); copy it to each host over a secure channel")


def _secret(path: Path | None) -> ClusterSecret:
    from server.cluster.auth import ClusterSecret

    try:
        secret = ClusterSecret.load(path)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--cluster-secret-file") from exc
    if secret is None:
        raise typer.BadParameter(f"a cluster process needs the cluster secret: --cluster-secret-file PATH (make one "
                                 f"with `agentshare cluster-secret PATH`) or {_SECRET_ENV}",
                                 param_hint="--cluster-secret-file")
    return secret


def _admin_key(path: Path | None) -> str | None:
    from server.cluster.auth import load_admin_key

    try:
        return load_admin_key(path)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--admin-key-file") from exc


def _router_config(codec: str, transport: str, threshold: int, bandwidth_aware: bool = True,
                   placement_policy: str = "offload") -> RouterConfig:
    from server.cluster.router import RouterConfig
    from server.policy import OffloadPolicy

    try:
        policy = OffloadPolicy(threshold_tokens=threshold, bandwidth_aware=bandwidth_aware)
        return RouterConfig(codec=codec, transport=transport, policy=policy, placement_policy=placement_policy)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


if __name__ == "__main__":
    app()
