"""From wire requests to engine prompts in the canonical layout (docs/design.md §2).

A chat request's shared context is every message but the last; the last is the agent's own
turn, so any agent of the family asked about the same conversation shares its prefill. A
completion's whole prompt is context (the agent's module computes from its last token on).

>>> class Chars:                                 # a toy tokenizer: one id per character
...     def encode(self, text, add_special_tokens): return [ord(c) for c in text]
>>> p = completion_prompts(Chars(), "abc")[0]
>>> p.token_ids, p.context_len
((97, 98, 99), 3)
>>> [q.token_ids for q in completion_prompts(Chars(), [[1, 2], [3]])]
[(1, 2), (3,)]
>>> completion_prompts(Chars(), [5, 70000], vocab_size=50000)
Traceback (most recent call last):
...
server.api.errors.ApiError: prompt: token id 70000 at position 1 is outside the vocabulary (0 to 49999)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentshare.protocol import ChatMessage, Tool
from server.api.errors import ApiError, unprocessable
from server.api.tools import ToolFormat, render_messages, template_tools, tool_format
from server.prompt import ChatTokenizer, Prompt, chat_prompt, text_prompt


def chat_request_prompt(tokenizer: ChatTokenizer, messages: Sequence[ChatMessage],
                        tools: Sequence[Tool] | None = None) -> Prompt:
    """context = messages[:-1], the agent's turn = messages[-1:]. With ``tools`` (an OpenAI chat
    request's, possibly none), tool calls, tool results and the tools are rendered in the
    tokenizer's :func:`~server.api.tools.tool_format`. In the ``template`` format the tools go to
    the template, and trailing tool results form the agent's final turn together (a template may
    render them as one block)."""
    native = tools is not None and tool_format(tokenizer) is ToolFormat.TEMPLATE
    rendered = ([m.as_template_message() for m in messages] if tools is None
                else render_messages(messages, tools, native=native))
    final = 1
    while native and final < len(messages) and messages[-final].role == messages[-final - 1].role == "tool":
        final += 1
    listed = template_tools(tools) if native and tools else None
    return chat_prompt(tokenizer, rendered[:-final], rendered[-final:], tools=listed, final=final)


def completion_prompts(tokenizer: ChatTokenizer, prompt: str | list[str] | list[int] | list[list[int]],
                       *, vocab_size: int | None = None) -> list[Prompt]:
    """One prompt per entry of a (possibly batched) completion ``prompt``: text or token ids
    (each below ``vocab_size``, when given)."""
    if isinstance(prompt, str):
        return [text_prompt(tokenizer, prompt)]
    if not prompt:
        raise unprocessable("prompt: send a string, a list of strings or token ids", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [_ids_prompt(prompt, vocab_size)]  # type: ignore[arg-type]
    out: list[Prompt] = []
    for p in prompt:
        if isinstance(p, str):
            out.append(text_prompt(tokenizer, p))
        elif isinstance(p, list) and all(isinstance(t, int) for t in p):
            out.append(_ids_prompt(p, vocab_size))
        else:
            raise ApiError(400, "prompt: mix of strings and token ids", param="prompt")
    return out


def context_tokens(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]]) -> tuple[int, ...]:
    """Token ids of a shared chat context alone, exactly as :func:`chat_prompt` lays it out."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=False)
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def text_tokens(tokenizer: ChatTokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()


def joined_prompt(context: Sequence[int], turn: Sequence[int]) -> Prompt:
    """A plain-text prompt from token ids: ``context`` then the agent's ``turn``."""
    ids = (*context, *turn)
    return Prompt(ids, len(context), len(context), len(ids))


def _ids_prompt(ids: Sequence[int], vocab_size: int | None) -> Prompt:
    if not ids:
        raise unprocessable("prompt: empty list of token ids", param="prompt")
    if vocab_size is not None:
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise unprocessable(f"prompt: token id {t} at position {i} is outside the vocabulary "
                                    f"(0 to {vocab_size - 1})", param="prompt")
    return joined_prompt(tuple(ids), ())
