"""Helpers shared by the server's test packages (plain functions, not fixtures)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from server.api.app import create_app
from server.api.config import ServerConfig
from server.engine.async_engine import AsyncEngine
from server.engine.core import EngineCore


@contextlib.contextmanager
def running_server(core: EngineCore | AsyncEngine, config: ServerConfig) -> Iterator[str]:
    """Serve a fresh engine (own KV pool) on 127.0.0.1:<free port>; yields the base URL. Given an
    :class:`AsyncEngine` (a test that stops it mid-request), serve that one instead."""
    import uvicorn

    engine = core if isinstance(core, AsyncEngine) else AsyncEngine(core.with_config(config.engine_config()))
    app = create_app(engine, config, owns_engine=True)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False,
                                           lifespan="on", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, name="api-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
