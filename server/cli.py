"""The ``agentshare`` command line.

    agentshare --help
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="agentshare",
    help="Serve multi-agent teams that share one prefill; fine-tune decode modules.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def main() -> None:
    """agentshare: one prefill of a shared context, many decode modules."""


@app.command()
def finetune(
    data: Annotated[Path, typer.Argument(help="JSONL rows: context, instruction, response")],
    output: Annotated[Path, typer.Option("--output", "-o", help="module directory to write")],
    name: Annotated[str, typer.Option(help="module name (letters, digits, . _ -)")],
    base: Annotated[Path | None, typer.Option(help="base model directory (default: SmolLM2-135M-Instruct)")] = None,
    kind: str = typer.Option("lora", help="lora or full"),
    rank: int = typer.Option(16), alpha: float = typer.Option(32.0),
    target: Annotated[list[str] | None, typer.Option(help="LoRA target module (repeat); default: all projections")] = None,
    placement: str = typer.Option("turn", help="invocation point: turn or header"),
    epochs: float = typer.Option(1.0), batch_size: int = typer.Option(8),
    lr: float | None = typer.Option(None, help="default 1e-3 (lora), 5e-5 (full)"),
    max_length: int = typer.Option(2048), seed: int = typer.Option(0),
    kv_dtype: str = typer.Option("bfloat16", help="KV dtype the server will use (part of the family)"),
    family: str | None = typer.Option(None, help="refuse a base not of this family digest"),
    bf16: bool = typer.Option(False, help="bf16 autocast matmuls (faster on CPUs with AMX)"),
    checkpoint_every: int = typer.Option(50), threads: int | None = typer.Option(None),
    standard: bool = typer.Option(False, help="train on the module's own prefill (no sharing, no manifest)"),
) -> None:
    """Fine-tune a decode module on the base model's KV (cache-conditioned); write it with its manifest."""
    from server.training.command import run_finetune

    raise typer.Exit(run_finetune(locals()))


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000),
    model: Path | None = typer.Option(None, help="base model directory (default: SmolLM2-135M-Instruct)"),
    module: list[str] | None = typer.Option(None, help="agent as NAME=PATH to a decode module (repeat)"),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16"),
    threads: int | None = typer.Option(None, help="torch threads (default: torch's choice)"),
    kv_cache: str = typer.Option("1GiB", help="KV pool size, e.g. 512MiB, 2GiB"),
    max_running: int = typer.Option(64, help="requests decoding together"),
    queue_limit: int = typer.Option(1024, help="requests waiting; beyond it: 429"),
    api_key: list[str] | None = typer.Option(
        None, envvar="AGENTSHARE_API_KEYS", help="accepted API key, one tenant each (repeat; or the env var, "
        "space-separated); none: no auth"),
    log_level: str = typer.Option("info"),
    context_ttl: float = typer.Option(600.0, help="default TTL of a pinned shared context, seconds"),
) -> None:
    """Serve the OpenAI-compatible and native API; every agent of the family shares prefill."""
    from server.api.serve import config_from_options
    from server.api.serve import serve as run_server

    run_server(config_from_options(locals()))


if __name__ == "__main__":
    app()
