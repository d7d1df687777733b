"""Structured logs: one JSON object per line, and never prompt or completion text by default.

Each request ends with one ``request`` record carrying its id, endpoint, agent, status,
latency and token counts (prompt, cached, completion) — figures, not content. While a trace
span is current (tracing on, :mod:`server.tracing`), every record carries its ``trace_id`` and
``span_id`` too.

>>> import logging
>>> rec = logging.LogRecord("agentshare.api", logging.INFO, "", 0, "done", (), None)
>>> rec.agent, rec.prompt_tokens = "coder", 12
>>> line = JsonFormatter().format(rec)
>>> '"agent": "coder"' in line and '"prompt_tokens": 12' in line
True
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from server import tracing

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra fields}`` per record."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v if isinstance(v, str | int | float | bool | None) else str(v)
        if "trace_id" not in out and (ids := tracing.current_ids()) is not None:
            out["trace_id"], out["span_id"] = ids
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(level: str = "info") -> None:
    """JSON lines on stderr for agentshare and uvicorn loggers (uvicorn's access log is off:
    the API logs each request itself)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in ("agentshare", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False

