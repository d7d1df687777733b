"""Shared contexts of the native API: prefilled once by the base, pinned for a TTL, extended
incrementally, and generated from by any agent of the family.

A context is a tenant's: another tenant neither sees it nor reads its blocks (its salt differs).
Each create or extend prefills under a fresh engine id and pins its full blocks; an extend
matches the previous version's pinned blocks, so only the new tokens are computed, then the
previous pin is released::

    create  ctx_1 v1: [ context ............ ]               computed: all
    extend  ctx_1 v2: [ context ............ | new messages ] computed: the new part only
            (v1's pin released once v2 is pinned)

Pins are bounded per tenant, so one tenant cannot pin the whole pool: at most ``max_contexts``
contexts, holding at most ``max_share`` of the KV pool's blocks (each context counts its full
blocks, even where two contexts share a prefix; at a share of 1 the pool itself is the bound).
Past either limit a create or extend gets 429, naming the limit, with Retry-After set to when
the tenant's first context expires; a context larger than the tenant's whole share gets 413.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from agentshare.protocol import ChatMessage, ContextInfo
from server.api.errors import ApiError, echo, from_engine, not_found, unprocessable
from server.api.metrics import Metrics
from server.api.prompts import context_tokens, joined_prompt, text_tokens
from server.backend import Backend
from server.engine.errors import Overloaded, PromptTooLong
from server.engine.sequence import FinishReason, Usage
from server.prompt import Prompt, chat_prompt


@dataclass(slots=True)
class ContextRecord:
    id: str
    salt: str
    kind: Literal["chat", "text"]
    messages: list[dict[str, str]]  # chat contexts
    token_ids: tuple[int, ...]
    engine_id: str
    ttl: float
    expires_at: float  # unix time
    cached_tokens: int = 0
    computed_tokens: int = 0
    version: int = 1
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def info(self, block_size: int) -> ContextInfo:
        return ContextInfo(id=self.id, kind=self.kind, tokens=len(self.token_ids), cached_tokens=self.cached_tokens,
                           computed_tokens=self.computed_tokens,
                           pinned_tokens=len(self.token_ids) // block_size * block_size,
                           ttl=self.ttl, expires_at=self.expires_at)

    def turn_prompt(self, tokenizer: Any, messages: list[ChatMessage] | None, text: str | None) -> Prompt:
        """The canonical prompt of an agent's turn after this context."""
        if self.kind == "text":
            if messages is not None:
                raise unprocessable("this is a text context: send the agent's turn as 'text'", param="messages")
            return joined_prompt(self.token_ids, text_tokens(tokenizer, text or ""))
        turn = [m.as_template_message() for m in messages] if messages is not None else [
            {"role": "user", "content": text or ""}]
        return chat_prompt(tokenizer, self.messages, turn)


class ContextStore:
    """The contexts of one server, by id, within each tenant's pin quota."""

    def __init__(self, backend: Backend, metrics: Metrics, tokenizer: Any, *, block_size: int = 16,
                 max_contexts: int = 64, max_share: float = 1.0) -> None:
        self._backend, self._metrics, self._tok = backend, metrics, tokenizer
        self._records: dict[str, ContextRecord] = {}
        self._block_size, self._max_contexts, self._max_share = block_size, max_contexts, max_share
        self._capacity = 0  # blocks of the KV pool, read once from the backend
        self._reserved: Counter[tuple[str, str]] = Counter()  # (salt, "contexts" | "blocks") being prefilled

    async def create(self, salt: str, messages: list[ChatMessage] | None, text: str | None, ttl: float) -> ContextRecord:
        self._prune()
        param = "messages" if messages is not None else "text"
        if messages is not None:
            msgs = [m.as_template_message() for m in messages]
            rec = ContextRecord(_new_id(), salt, "chat", msgs, context_tokens(self._tok, msgs), "", ttl, 0.0)
        else:
            rec = ContextRecord(_new_id(), salt, "text", [], text_tokens(self._tok, text or ""), "", ttl, 0.0)
        if not rec.token_ids:
            raise unprocessable(f"{param}: the context is empty", param=param)
        rec.engine_id = f"{rec.id}/v1"
        blocks = len(rec.token_ids) // self._block_size
        await self._check_quota(salt, contexts=1, blocks=blocks, size=blocks, param=param)
        with self._reserve(salt, contexts=1, blocks=blocks):
            usage = await self._prefill(rec.engine_id, rec.token_ids, ttl, salt, param)
            rec.cached_tokens, rec.computed_tokens = usage.cached_tokens, len(rec.token_ids) - usage.cached_tokens
            rec.expires_at = time.time() + ttl
            self._records[rec.id] = rec
        return rec

    async def extend(self, salt: str, context_id: str, messages: list[ChatMessage] | None, text: str | None,
                     ttl: float | None) -> ContextRecord:
        rec = self.get(salt, context_id)
        async with rec.lock:
            rec = self.get(salt, context_id)  # may have expired while waiting
            if rec.kind == "chat":
                if messages is None:
                    messages = [ChatMessage(role="user", content=text or "")]
                msgs = rec.messages + [m.as_template_message() for m in messages]
                ids = context_tokens(self._tok, msgs)
            else:
                if messages is not None:
                    raise unprocessable("this is a text context: extend it with 'text'", param="messages")
                msgs, ids = [], rec.token_ids + text_tokens(self._tok, text or "")
            ttl = ttl or rec.ttl
            engine_id = f"{rec.id}/v{rec.version + 1}"
            param = "messages" if rec.kind == "chat" and messages is not None else "text"
            size = len(ids) // self._block_size
            grown = size - len(rec.token_ids) // self._block_size
            await self._check_quota(salt, contexts=0, blocks=grown, size=size, param=param)
            with self._reserve(salt, contexts=0, blocks=grown):
                usage = await self._prefill(engine_id, ids, ttl, salt, param)
            old = rec.engine_id
            await self._backend.release_context(old)
            rec.messages, rec.token_ids, rec.engine_id, rec.version = msgs, ids, engine_id, rec.version + 1
            rec.cached_tokens, rec.computed_tokens = usage.cached_tokens, len(ids) - usage.cached_tokens
            rec.ttl, rec.expires_at = ttl, time.time() + ttl
            return rec

    async def release(self, salt: str, context_id: str) -> bool:
        rec = self.get(salt, context_id)
        self._records.pop(rec.id, None)
        return await self._backend.release_context(rec.engine_id)

    def get(self, salt: str, context_id: str) -> ContextRecord:
        """A live context of this tenant; 404 otherwise (unknown, another tenant's, expired)."""
        self._prune()
        rec = self._records.get(context_id)
        if rec is None or rec.salt != salt:
            raise not_found(f"no context {echo(context_id)} (unknown, released or expired)", param="context_id")
        return rec

    def _prune(self) -> None:
        now = time.time()
        for cid in [c for c, r in self._records.items() if r.expires_at <= now and not r.lock.locked()]:
            del self._records[cid]

    async def _check_quota(self, salt: str, *, contexts: int, blocks: int, size: int, param: str) -> None:
        """Refuse ``contexts`` more pins holding ``blocks`` more blocks (the context then holds
        ``size``) past this tenant's quota: 429, or 413 if the context alone exceeds it."""
        if self._max_share < 1 and not self._capacity:  # (at 1 the pool itself is the bound: the engine's)
            self._capacity = (await self._backend.snapshot()).blocks_capacity
        limit = math.floor(self._max_share * self._capacity) if self._max_share < 1 and self._capacity else None
        mine = [r for r in self._records.values() if r.salt == salt]
        held = sum(len(r.token_ids) // self._block_size for r in mine) + self._reserved[salt, "blocks"]
        count = len(mine) + self._reserved[salt, "contexts"]
        if limit is not None and size > limit:
            raise ApiError(413, f"{param}: the context needs {size} KV blocks, more than one tenant may pin "
                           f"({limit} blocks, max_pinned_share {self._max_share:g} of the pool); shorten it",
                           param=param, code="context_length_exceeded")
        if count + contexts > self._max_contexts:
            reason = (f"tenant quota: at most {self._max_contexts} pinned contexts per tenant "
                      f"(max_pinned_contexts), and this tenant holds {count}")
        elif limit is not None and held + blocks > limit:
            reason = (f"tenant quota: this tenant's pinned contexts may hold {limit} KV blocks "
                      f"(max_pinned_share {self._max_share:g} of the pool); they hold {held} and this needs "
                      f"{blocks} more")
        else:
            return
        wait = min((r.expires_at for r in mine), default=time.time() + 1) - time.time()
        self._metrics.rejected.labels("tenant_quota").inc()
        raise ApiError(429, f"{reason}; release a context (DELETE /v1/contexts/{{id}}) or retry after one expires",
                       type="rate_limit_error", code="quota_exceeded",
                       headers={"Retry-After": str(max(1, math.ceil(wait)))})

    @contextlib.contextmanager
    def _reserve(self, salt: str, *, contexts: int, blocks: int) -> Iterator[None]:
        """Count a pin being prefilled against its tenant's quota (checks and prefills interleave)."""
        self._reserved[salt, "contexts"] += contexts
        self._reserved[salt, "blocks"] += blocks
        try:
            yield
        finally:
            self._reserved[salt, "contexts"] -= contexts
            self._reserved[salt, "blocks"] -= blocks

    async def _prefill(self, engine_id: str, ids: tuple[int, ...], ttl: float, salt: str, param: str) -> Usage:
        """Prefill and pin ``ids``; wait until pinned. Cancelled (client gone): frees its KV."""
        try:
            done = await self._backend.add_context(engine_id, ids, ttl=ttl, salt=salt)
        except Overloaded as exc:
            self._metrics.rejected.labels(exc.reason).inc()
            raise
        except PromptTooLong as exc:
            raise from_engine(exc, prompt_param=param) from exc
        if done.finish_reason is not FinishReason.PREFILLED:
            reason = done.finish_reason.value if done.finish_reason is not None else "no finish reason"
            raise ApiError(503, f"the context's prefill ended with {reason}",
                           type="service_unavailable")
        assert done.usage is not None
        return done.usage


def _new_id() -> str:
    return f"ctx_{uuid.uuid4().hex[:24]}"
