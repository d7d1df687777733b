"""Operations: ``/health`` (liveness plus queue depth) and Prometheus ``/metrics``.

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
    state = server_state(request)
    snap = await state.backend.snapshot()
    return Health(family=state.facts.family, agents=len(state.facts.agents), waiting=snap.waiting, running=snap.running)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    state.metrics.update(await state.backend.snapshot())
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
