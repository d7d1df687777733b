"""Every failure of the HTTP API, as one exception type rendered in OpenAI's error shape.

::

    status  type                     when
    400     invalid_request_error    the body cannot be read: not JSON, wrong JSON types, a field missing,
                                     text that is not valid Unicode (a lone surrogate); or it asks for a
                                     sampling knob this server does not implement (``min_p``, ...)
    401     authentication_error     keys are configured and the request has no valid one
    404     invalid_request_error    unknown agent (code model_not_found), context or route
    413     invalid_request_error    the prompt does not fit the context or the KV pool
    422     invalid_request_error    readable, but a value is not acceptable (negative limits, ...)
    429     rate_limit_error         the queue limit is reached, pinned contexts fill the pool, or a
                                     tenant's pinned-context quota is used up (with a Retry-After header)
    503     service_unavailable      the engine is shutting down, or no worker can serve the request

>>> err = from_engine(Overloaded("busy", retry_after=2.5))
>>> err.status, err.headers["Retry-After"], err.body()["error"]["code"]
(429, '3', 'overloaded')
>>> classify_validation([{"type": "greater_than_equal", "loc": ("body", "n"), "msg": "too small"}]).status
422

``param`` names the request field at fault: the first element of the error's location, or, for
a check across fields, the field its message starts with:

>>> classify_validation([{"type": "value_error", "loc": ("body",), "msg": "Value error, seed: too big"}]).param
'seed'
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from agentshare.protocol import ErrorResponse
from server.engine.async_engine import EngineClosed
from server.engine.errors import (
    EngineError,
    InvalidRequest,
    Overloaded,
    PromptTooLong,
    Unavailable,
    UnknownModule,
)

log = logging.getLogger("agentshare.api")

# pydantic error types that mean "the body could not be read" (400) rather than "a value is bad" (422)
_READ_ERRORS = {"json_invalid", "missing", "model_attributes_type", "union_tag_invalid", "model_type",
                "invalid_unicode", "string_unicode", "unsupported_parameter"}
_UNICODE_ERRORS = {"invalid_unicode", "string_unicode"}
_FIELD_PREFIX = re.compile(r"^([a-z_][a-z0-9_]*): ")
_MAX_ECHO = 200  # characters of a client's value echoed in a message


class ApiError(Exception):
    """An HTTP error with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return ErrorResponse.of(self.message, type=self.type, param=self.param, code=self.code).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def not_found(what: str, *, param: str | None = None, code: str = "not_found") -> ApiError:
    return ApiError(404, what, param=param, code=code)


def unprocessable(message: str, *, param: str | None = None) -> ApiError:
    return ApiError(422, message, param=param, code="invalid_value")


def overloaded(message: str, retry_after: float) -> ApiError:
    return ApiError(429, message, type="rate_limit_error", code="overloaded",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after)))})


def echo(value: str) -> str:
    """A client's value, quoted for an error message, cut to a readable length."""
    return repr(value if len(value) <= _MAX_ECHO else value[:_MAX_ECHO] + "...")


def from_engine(exc: EngineError, *, prompt_param: str = "messages") -> ApiError:
    """The HTTP form of an engine error (``prompt_param``: the field that carried the prompt)."""
    if isinstance(exc, PromptTooLong):
        return ApiError(413, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return unprocessable(str(exc))
    if isinstance(exc, UnknownModule):
        return not_found(f"{exc}. List agents with GET /v1/models", param="model", code="model_not_found")
    if isinstance(exc, Overloaded):
        return overloaded(str(exc), exc.retry_after)
    if isinstance(exc, EngineClosed):
        return ApiError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
    if isinstance(exc, Unavailable):
        return ApiError(503, str(exc), type="service_unavailable", code="unavailable",
                        headers={"Retry-After": "1"})
    return ApiError(500, f"engine error: {exc}", type="server_error", code="engine_error")


def classify_validation(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """400 when the body cannot be read as the request type, 422 when a value is out of range."""
    if any(e.get("type") in _UNICODE_ERRORS for e in errors):
        # the other branches of a union (``str | list[str]``) only add noise
        errors = [e for e in errors if e.get("type") in _UNICODE_ERRORS]
    unreadable = any(_is_read_error(str(e.get("type", ""))) for e in errors)
    parts: list[str] = []
    param = None
    for e in errors[:3]:
        loc = _field_path(e.get("loc", ()))
        if e.get("type") == "json_invalid":
            detail = (e.get("ctx") or {}).get("error", "")
            parts.append(f"the body is not valid JSON ({detail})" if detail else "the body is not valid JSON")
            continue
        field = ".".join(loc)
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        named = _FIELD_PREFIX.match(msg)
        param = param or (loc[0] if loc else named[1] if named else None)
        part = f"{field}: {msg}" if field and not msg.startswith(f"{field}:") else msg
        if part not in parts:
            parts.append(part)
    if len(errors) > 3:
        parts.append(f"(and {len(errors) - 3} more)")
    message = "; ".join(parts) or "invalid request"
    if unreadable:
        return ApiError(400, message, param=param, code="invalid_request")
    return unprocessable(message, param=param)


def _is_read_error(kind: str) -> bool:
    return kind in _READ_ERRORS or kind.endswith(("_type", "_parsing"))


def _field_path(loc: Sequence[object]) -> list[str]:
    """The field names and indices of a pydantic location, without ``body`` and the type tags
    pydantic adds for the branches of a union (``str``, ``list[int]``, ``function-after[...]``)."""
    return [str(p) for p in loc if p != "body" and not (isinstance(p, str) and _is_type_tag(p))]


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool", "list", "dict", "none"} or part[:1].isupper()


def install_error_handlers(app: FastAPI) -> None:
    """Render every error (ours, validation, routing, unexpected) in the OpenAI shape."""

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def engine_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EngineError)
        return from_engine(exc).response()

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return classify_validation(exc.errors()).response()

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        message = {404: "no such endpoint; see docs/server.md", 405: "method not allowed"}.get(status, str(exc.detail))
        return ApiError(status, message, code="not_found" if status == 404 else None,
                        headers=exc.headers).response()

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", extra={"event": "error", "error": type(exc).__name__})
        return ApiError(500, "internal server error", type="server_error", code="internal_error").response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(EngineError, engine_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
