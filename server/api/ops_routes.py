"""Operations: ``/health`` (liveness, queue depth, and whether every agent can be served) and
Prometheus ``/metrics``.

Both are open (no API key): they carry figures, never prompts or keys.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from agentshare.protocol import Health
from server.api.deps import server_state
from server.api.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health", response_model=Health)
async def health(request: Request) -> Health:
    """Answers without waiting on the engine: ``degraded``, with the reasons, when an engine is
    stuck or stopped or (behind a router) some agent has no decode worker up."""
    state = server_state(request)
    h = state.backend.health()
    return Health(status="degraded" if h.degraded else "ok", family=state.facts.family,
                  agents=len(state.facts.agents), waiting=h.waiting, running=h.running, reasons=list(h.degraded))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    state.metrics.update(await state.backend.snapshot())
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
