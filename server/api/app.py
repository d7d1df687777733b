"""The app factory: an ASGI app over one engine, with all its state built here.

::

    app = create_app(AsyncEngine(load_engine(model_dir)), ServerConfig(api_keys=("k",)))
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api import native_routes, openai_routes, ops_routes
from server.api.config import ServerConfig
from server.api.contexts import ContextStore
from server.api.errors import install_error_handlers
from server.api.metrics import Metrics
from server.api.state import EngineFacts, ServerState
from server.api.tenancy import Tenancy
from server.engine.async_engine import AsyncEngine

log = logging.getLogger("agentshare.api")


def create_app(engine: AsyncEngine, config: ServerConfig | None = None, *, owns_engine: bool = False) -> FastAPI:
    """An app serving ``engine``. With ``owns_engine`` the app closes the engine on shutdown."""
    config = config or ServerConfig()
    facts = EngineFacts.of(engine.core)  # before serving: nothing else touches the core yet
    metrics = Metrics()
    contexts = ContextStore(engine, metrics, facts.tokenizer)
    state = ServerState(engine, config, facts, Tenancy(config.api_keys), metrics, contexts, owns_engine=owns_engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        log.info("serving", extra={"event": "start", "family": facts.family, "agents": ",".join(facts.agents),
                                   "auth": config.auth_required})
        yield
        if owns_engine:
            engine.close()

    app = FastAPI(title="agentshare", version="0.1", lifespan=lifespan,
                  description="OpenAI-compatible and native API; agents of one family share prefill.")
    app.state.server = state
    install_error_handlers(app)
    for module in (openai_routes, native_routes, ops_routes):
        app.include_router(module.router)
    app.add_middleware(RequestLogMiddleware, metrics=metrics)
    return app


class RequestLogMiddleware:
    """One structured log record and one counter increment per HTTP request (after its last
    byte, so streamed requests are logged with their final figures)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            fields: dict[str, Any] = dict(scope.get("state", {}).get("log", {}))
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            log.info("request", extra={"event": "request", "method": scope["method"], "endpoint": endpoint,
                                       "status": status[0], "latency_ms": round(1000 * (time.monotonic() - start), 1),
                                       **fields})
