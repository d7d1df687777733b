"""The embedded default: AsyncClient() launches a local server and stops it on close — also
when the body raises — and a server that cannot start fails fast with its log tail."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import anyio
import pytest

from agentshare import AsyncClient, ServerStartError
from tests.sdk.conftest import server_args

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


def gone(pid: int) -> bool:
    """The process has exited and been reaped (no zombie left either)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def options(model: Path) -> dict[str, object]:
    args = server_args(model)
    return {"model": model, "dtype": "float32", "server_args": args[4:], "startup_timeout": 120}


async def test_launches_serves_and_stops_even_when_the_body_raises(tiny_model_dir: Path) -> None:
    client = AsyncClient(**options(tiny_model_dir))  # type: ignore[arg-type]
    assert client.server is not None and not client.server.running
    with pytest.raises(RuntimeError, match="boom"):
        async with client:
            assert client.server.running and client.base_url
            assert client.base_url.startswith("http://127.0.0.1:")
            pid = client.server.process.pid  # type: ignore[union-attr]
            ctx = await client.context("The launch test context. " * 20)
            a = await ctx.generate("base", "Summarise.", max_tokens=3, temperature=0)
            assert a.usage.completion_tokens == 3
            assert (await client.health()).status == "ok"
            raise RuntimeError("boom")
    assert gone(pid) and not client.server.running
    assert client.server.log_path is None  # its log file is removed too


async def test_lazy_start_on_first_use_then_aclose(tiny_model_dir: Path) -> None:
    client = AsyncClient(**options(tiny_model_dir))  # type: ignore[arg-type]
    try:
        assert [s.name for s in await client.agents()] == ["base"]
        pid = client.server.process.pid  # type: ignore[union-attr]
    finally:
        await client.aclose()
    assert gone(pid)


async def test_a_server_that_cannot_start_says_why_within_the_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    client = AsyncClient(model=tmp_path / "no-such-model", dtype="float32", startup_timeout=60)
    with pytest.raises(ServerStartError) as err:
        async with client:
            pass
    assert time.monotonic() - start < 60
    assert "exited" in str(err.value) and err.value.log_tail  # the server's own last words
    assert "no-such-model" in err.value.log_tail
    assert client.server is not None and not client.server.running


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
async def test_the_server_dies_with_a_parent_that_exits_without_cleaning_up(tiny_model_dir: Path) -> None:
    """A client process killed hard (no aclose, no atexit) leaves no server behind."""
    import subprocess

    code = (
        "import anyio, os, sys\n"
        "from agentshare import AsyncClient\n"
        "async def main():\n"
        f"    client = AsyncClient(model={str(tiny_model_dir)!r}, dtype='float32', server_args=['--threads', '1'])\n"
        "    await client.start()\n"
        "    print(client.server.process.pid, flush=True)\n"
        "    os._exit(0)\n"
        "anyio.run(main)\n"
    )
    out = await anyio.run_process([sys.executable, "-c", code], check=True, stderr=subprocess.DEVNULL)
    pid = int(out.stdout.split()[-1])
    for _ in range(100):  # the kernel signals the orphan; it is reaped by init
        if gone(pid) or _zombie(pid):
            break
        await anyio.sleep(0.1)
    assert gone(pid) or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return True
