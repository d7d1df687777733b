"""Errors of the engine, as the API layer maps them to responses.

::

    EngineError
     ├── InvalidRequest        bad input: empty prompt, bad sampling values (HTTP 400/422)
     │    └── PromptTooLong    the prompt does not fit the model's context (HTTP 413)
     ├── UnknownModule         no decode module of that name (HTTP 404)
     ├── Overloaded            the KV pool or the queue is full: retry later (HTTP 429)
     ├── Unavailable           no worker can serve it now (a cluster's workers are down) (HTTP 503)
     └── RequestCancelled      the request was cancelled (client gone)

KV-level errors (``server.kv.errors``) stay inside the engine: it turns ``PoolExhausted`` into
``Overloaded``.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises to its callers."""


class InvalidRequest(EngineError, ValueError):
    """The request is malformed; the message says what to fix."""


class PromptTooLong(InvalidRequest):
    """The prompt (plus room to generate) does not fit the model's context or the KV pool."""

    def __init__(self, prompt_tokens: int, limit: int, *, what: str = "the model's context") -> None:
        self.prompt_tokens, self.limit = prompt_tokens, limit
        super().__init__(
            f"the request needs {prompt_tokens} tokens but {what} holds {limit}; "
            "shorten the prompt or lower max_tokens"
        )


class UnknownModule(EngineError, LookupError):
    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        super().__init__(f"unknown decode module {name!r}; known: {', '.join(sorted(known)) or 'none'}")


class Overloaded(EngineError):
    """No room now; ``reason`` is a metric label (``queue_full``, ``kv_pool_pinned``)."""

    def __init__(self, message: str, retry_after: float = 1.0, *, reason: str = "queue_full") -> None:
        self.retry_after, self.reason = retry_after, reason
        super().__init__(message)


class Unavailable(EngineError):
    """Nothing can serve the request right now (in a cluster: no live worker for it)."""


class RequestCancelled(EngineError):
    """The request was cancelled before it finished."""
