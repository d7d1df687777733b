"""Per-request lookups shared by the routes: the server state, the caller's tenant, an agent."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Depends, Request

from server.api.errors import echo, not_found
from server.api.state import ServerState
from server.api.tenancy import Tenant
from server.backend import AgentCard


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def tenant(request: Request) -> Tenant:
    """The caller's tenant (401 when keys are configured and none is valid)."""
    t = server_state(request).tenancy.authenticate(request.headers.get("authorization"))
    request.state.log = {**getattr(request.state, "log", {}), "tenant": t.label}
    return t


def agent(state: ServerState, name: str, *, param: str = "model") -> AgentCard:
    card = state.facts.agents.get(name)
    if card is None:
        known = ", ".join(sorted(state.facts.agents))
        raise not_found(f"unknown agent {echo(name)}; known: {known}. List agents with GET /v1/models",
                        param=param, code="model_not_found")
    return card


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def note(request: Request, **fields: object) -> None:
    """Attach figures (never prompt text) to this request's log record."""
    request.state.log = {**getattr(request.state, "log", {}), **fields}


Caller = Annotated[Tenant, Depends(tenant)]
"""A route parameter: the authenticated caller's tenant."""
