"""The ``agentshare`` command line.

    agentshare --help
"""

from __future__ import annotations

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


if __name__ == "__main__":
    app()
