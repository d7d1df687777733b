"""Every error the SDK raises, in one tree::

    AgentshareError
     ├── ServerStartError        the local server did not come up (its last log lines attached)
     ├── ConnectionFailed        no server answered at the URL
     └── APIError                the server answered with an error (status, message, type, code)
          ├── BadRequestError        400, 413, 422: the request is wrong; the message says how
          ├── AuthenticationError    401, 403: missing or unknown API key
          ├── NotFoundError          404: unknown agent (model) or context
          ├── RateLimitError         429: pool or queue full; retry after ``retry_after`` seconds
          └── InternalServerError    5xx

>>> err = error_from_response(404, {"error": {"message": "unknown agent 'x'", "type": "not_found"}})
>>> isinstance(err, NotFoundError), str(err)
(True, "404 not_found: unknown agent 'x'")
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any


class AgentshareError(Exception):
    """Base of every agentshare SDK error."""


class ServerStartError(AgentshareError):
    """The local server process exited or did not become healthy in time."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        self.log_tail = log_tail
        super().__init__(message + (f"\n--- last server log lines ---\n{log_tail}" if log_tail else ""))


class ConnectionFailed(AgentshareError):
    """The server could not be reached."""


class APIError(AgentshareError):
    """The server refused or failed a request."""

    def __init__(self, status: int, message: str, *, type: str = "", code: str | None = None,
                 param: str | None = None, retry_after: float | None = None) -> None:
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after = retry_after
        super().__init__(f"{status} {type}: {message}" if type else f"{status}: {message}")


class BadRequestError(APIError):
    """400, 413, 422: the request is wrong; the message (and ``param``) says how."""


class AuthenticationError(APIError):
    """401, 403: a missing or unknown API key."""


class NotFoundError(APIError):
    """404: an unknown agent (model) or context (released, expired, or another tenant's)."""


class RateLimitError(APIError):
    """429: the pool, the queue or the tenant's quota is full; retry after ``retry_after`` seconds."""


class InternalServerError(APIError):
    """5xx: the server failed the request."""


def error_from_response(status: int, body: Any, *, retry_after: str | None = None) -> APIError:
    """The :class:`APIError` subclass for an error response (OpenAI's error shape)."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message, etype, code = str(err.get("message", "")), str(err.get("type", "")), err.get("code")
        param = err.get("param")
    else:
        message, etype, code, param = str(body), "", None, None
    cls: type[APIError]
    if status in (401, 403):
        cls = AuthenticationError
    elif status == 404:
        cls = NotFoundError
    elif status == 429:
        cls = RateLimitError
    elif status >= 500:
        cls = InternalServerError
    else:
        cls = BadRequestError
    return cls(status, message, type=etype, code=code, param=None if param is None else str(param),
               retry_after=_seconds(retry_after))


def _seconds(retry_after: str | None) -> float | None:
    # Retry-After is delta-seconds or an HTTP-date (RFC 9110 10.2.3); anything else is dropped
    if not retry_after or not (value := retry_after.strip()):
        return None
    try:
        seconds = float(value)
        if seconds < 0:  # not delta-seconds
            return None
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None
