"""The canonical layout of a request, and where its invocation point falls (docs/design.md §2).

Used alike by the engine, the API and the fine-tuning tool, so that a module is served with
exactly the boundary it was trained with::

    [ shared context ............ ] [ agent's turn: instruction | <assistant header> | generated ]
                                    ^ turn                       ^ header
     positions < IP: base model      positions >= IP: the agent's decode module

- ``turn`` (default): the IP is the first token of the agent's final turn (its instruction);
- ``header``: the IP is the first token of the generation prompt (Activated LoRA's rule).

Chat prompts are rendered with the tokenizer's own chat template, one piece at a time, and the
pieces must be prefixes of one another (a template that rewrites earlier text when a message is
added cannot share a prefix, and is refused with a clear error).

>>> class Toy:                                   # a toy chat template: "<role>content|"
...     def apply_chat_template(self, messages, tokenize, add_generation_prompt):
...         return "".join(f"<{m['role']}>{m['content']}|" for m in messages) + (
...             "<assistant>" if add_generation_prompt else "")
...     def encode(self, text, add_special_tokens): return [ord(c) for c in text]
>>> p = chat_prompt(Toy(), [{"role": "user", "content": "doc"}], [{"role": "user", "content": "q"}])
>>> p.context_len, p.invocation_point(Placement.TURN), p.invocation_point(Placement.HEADER)
(10, 10, 18)
>>> "".join(map(chr, p.token_ids[p.invocation_point(Placement.TURN):]))
'<user>q|<assistant>'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from server.engine.errors import InvalidRequest

Message = Mapping[str, Any]


class Placement(StrEnum):
    """Where a module's invocation point sits; recorded in its manifest at training time."""

    TURN = "turn"
    HEADER = "header"


class ChatTokenizer(Protocol):
    def apply_chat_template(self, messages: Any, *, tokenize: bool, add_generation_prompt: bool) -> Any: ...
    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Prompt:
    """Token ids of one request in canonical order, with its boundaries.

    ``context_len``: tokens of the shared context; ``turn_start``: first token of the agent's
    final turn; ``header_start``: first token of the generation prompt (``len(token_ids)`` for a
    plain-text prompt, which has none).
    """

    token_ids: tuple[int, ...]
    context_len: int
    turn_start: int
    header_start: int

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise InvalidRequest("the prompt is empty; send at least one message or some text")
        if not 0 <= self.context_len <= self.turn_start <= self.header_start <= len(self.token_ids):
            raise ValueError(f"inconsistent prompt boundaries {self.context_len}, "
                             f"{self.turn_start}, {self.header_start} of {len(self.token_ids)}")

    def invocation_point(self, placement: Placement) -> int:
        """The first position computed by the decode module (every earlier one: the base).

        Never past the last prompt token: the module always computes at least the position
        whose logits pick the first generated token.
        """
        ip = self.turn_start if placement is Placement.TURN else self.header_start
        return min(ip, len(self.token_ids) - 1)


def chat_prompt(
    tokenizer: ChatTokenizer,
    context: Sequence[Message],
    turn: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    final: int = 1,
) -> Prompt:
    """Lay out ``context`` (shared messages) then ``turn`` (the agent's own, last = its instruction).

    ``tools`` go to the template as ``tools=`` (a template that renders them). ``final``: how many
    of ``turn``'s last messages form its final turn, for templates that render several messages
    as one block (Qwen's template joins consecutive tool results into one user turn); the final
    turn starts at its first message.
    """
    if not turn:
        raise InvalidRequest("the agent's turn is empty: it needs at least its instruction message")
    if not 1 <= final <= len(turn):
        raise ValueError(f"final={final} must be within the turn's {len(turn)} messages")
    for m in [*context, *turn]:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequest(f"every message needs a string 'role' and 'content'; got {dict(m)!r}")
    extra = {"tools": list(tools)} if tools else {}

    def render(messages: Sequence[Message], gen: bool) -> list[int]:
        if not messages:
            return []
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=gen, **extra)
        return list(tokenizer.encode(text, add_special_tokens=False))

    ctx = render(context, False)
    before_turn = render([*context, *turn[:-final]], False)
    without_header = render([*context, *turn], False)
    full = render([*context, *turn], add_generation_prompt)
    for part, name in (
        (ctx, "shared context"),  # pragma: no mutate
        (before_turn, "agent's earlier messages"),  # pragma: no mutate
        (without_header, "agent's instruction"),  # pragma: no mutate
    ):
        if full[: len(part)] != part:
            raise InvalidRequest(
                f"the chat template renders the {name} differently once later messages follow, "
                "so no prefix can be shared; use a prefix-stable template"
            )
    return Prompt(tuple(full), len(ctx), len(before_turn), len(without_header))


def text_prompt(tokenizer: ChatTokenizer, context: str, turn: str = "") -> Prompt:
    """A plain-text prompt: ``context`` then ``turn``, tokenized separately and concatenated."""
    ctx = list(tokenizer.encode(context, add_special_tokens=False)) if context else []
    own = list(tokenizer.encode(turn, add_special_tokens=False)) if turn else []
    ids = tuple(ctx + own)
    return Prompt(ids, len(ctx), len(ctx), len(ids))
