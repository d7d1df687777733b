"""Engine events → OpenAI response objects (whole responses and stream chunks).

The stream rules it enforces: a choice's first chunk carries its first text (never an empty
role-only chunk ahead of any token), and each choice has exactly one ``finish_reason``, on its
last chunk. Usage counts each prompt once: ``cached_tokens`` is the part of the prompt no
choice had to compute (the minimum over its choices).

>>> from server.engine.sequence import TokenEvent, FinishReason, Usage as EU
>>> from server.api.generation import ChoiceEvent
>>> acc = Choices(n_per_prompt=1, total=1)
>>> _ = acc.add(ChoiceEvent(0, TokenEvent("r", 5, "Hi", finish_reason=FinishReason.STOP, usage=EU(7, 4, 1))))
>>> acc.usage().model_dump()["prompt_tokens_details"]
{'cached_tokens': 4}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from agentshare.protocol import (
    ChoiceLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from server.api.generation import ChoiceEvent
from server.engine.sequence import FinishReason, TokenEvent
from server.engine.sequence import Usage as EngineUsage

Finish = Literal["stop", "length"]


def finish_of(reason: FinishReason | None) -> Finish | None:
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"


@dataclass(slots=True)
class ChoiceState:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)  # token events (for logprobs)
    finish: FinishReason | None = None
    usage: EngineUsage | None = None
    started: bool = False  # its first chunk went out


class Choices:
    """The state of every choice of one request."""

    def __init__(self, *, n_per_prompt: int, total: int) -> None:
        self.n = n_per_prompt
        self.states = [ChoiceState() for _ in range(total)]

    def add(self, item: ChoiceEvent) -> ChoiceState:
        st, ev = self.states[item.index], item.event
        st.text.append(ev.text)
        if ev.token_id is not None:
            st.token_ids.append(ev.token_id)
            st.events.append(ev)
        if ev.finish_reason is not None:
            st.finish, st.usage = ev.finish_reason, ev.usage
        return st

    def usage(self) -> Usage:
        prompt = cached = completion = 0
        for first in range(0, len(self.states), self.n):
            group = [s.usage for s in self.states[first : first + self.n] if s.usage is not None]
            if not group:
                continue
            prompt += group[0].prompt_tokens
            cached += min(u.cached_tokens for u in group)
            completion += sum(u.completion_tokens for u in group)
        return Usage.of(prompt, completion, cached)


class TokenText:
    """Text of single tokens, for logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def __call__(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def chat(self, events: list[TokenEvent]) -> ChoiceLogprobs:
        content = []
        for ev in events:
            assert ev.token_id is not None
            tok = self(ev.token_id)
            top = [TopLogprob(token=(t := self(i)), logprob=lp, bytes=list(t.encode())) for i, lp in ev.top_logprobs]
            content.append(TokenLogprob(token=tok, logprob=ev.logprob if ev.logprob is not None else 0.0,
                                        bytes=list(tok.encode()), top_logprobs=top))
        return ChoiceLogprobs(content=content)

    def completion(self, events: list[TokenEvent], offset: int = 0) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for ev in events:
            assert ev.token_id is not None
            tok = self(ev.token_id)
            out.tokens.append(tok)
            out.token_logprobs.append(ev.logprob if ev.logprob is not None else 0.0)
            out.top_logprobs.append({self(i): lp for i, lp in ev.top_logprobs})
            out.text_offset.append(offset)
            offset += len(tok)
        return out
