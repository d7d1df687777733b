"""The app factory: an ASGI app over one engine, with all its state built here.

::

    app = create_app(AsyncEngine(load_engine(model_dir)), ServerConfig(api_keys=("k",)))
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import tracing
from server.api import native_routes, openai_routes, ops_routes
from server.api.config import ServerConfig
from server.api.contexts import ContextStore
from server.api.errors import install_error_handlers
from server.api.local_backend import LocalBackend
from server.api.metrics import Metrics
from server.api.state import ServerState
from server.api.tenancy import Tenancy
from server.backend import Backend
from server.engine.async_engine import AsyncEngine

log = logging.getLogger("agentshare.api")


class AppPlugin(Protocol):
    """Extra routes with a life of their own (a worker's internal API, the router's membership)."""

    router: APIRouter

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def create_app(
    engine: AsyncEngine | Backend, config: ServerConfig | None = None, *, owns_engine: bool = False,
    plugins: Sequence[AppPlugin] = (),
) -> FastAPI:
    """An app serving ``engine`` (a local :class:`AsyncEngine`, or any :class:`Backend` such as
    the cluster router). With ``owns_engine`` the app closes it on shutdown. ``plugins`` add
    routes, started after the app's own start-up and stopped before it closes the engine."""
    config = config or ServerConfig()
    backend: Backend = LocalBackend(engine) if isinstance(engine, AsyncEngine) else engine
    facts = backend.facts
    metrics = Metrics()
    collectors = {id(c): c for source in (backend, *plugins) if (c := getattr(source, "collector", None)) is not None}
    for collector in collectors.values():  # a backend's or plugin's own figures (routing, refused calls)
        metrics.registry.register(collector)
    contexts = ContextStore(backend, metrics, facts.tokenizer, block_size=facts.block_size,
                            max_contexts=config.max_pinned_contexts, max_share=config.pinned_share)
    state = ServerState(backend, config, facts, Tenancy(config.api_keys), metrics, contexts, owns_backend=owns_engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        log.info("serving", extra={"event": "start", "family": facts.family, "agents": ",".join(facts.agents),
                                   "auth": config.auth_required})
        for plugin in plugins:
            await plugin.start()
        try:
            yield
        finally:
            for plugin in reversed(plugins):
                await plugin.stop()
        if owns_engine:
            backend.close()

    app = FastAPI(title="agentshare", version="0.1", lifespan=lifespan,
                  description="OpenAI-compatible and native API; agents of one family share prefill.")
    app.state.server = state
    install_error_handlers(app)
    for module in (openai_routes, native_routes, ops_routes):
        app.include_router(module.router)
    for plugin in plugins:
        app.include_router(plugin.router)
    app.add_middleware(RequestLogMiddleware, metrics=metrics)
    app.add_middleware(tracing.TraceMiddleware)  # outermost: the request's log record carries its trace
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
