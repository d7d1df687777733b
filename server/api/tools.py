"""OpenAI tools and structured outputs on a chat request: how tools and calls are written into
the prompt, the constraint that holds the output to a tool call or a schema, and the parser that
turns output into tool calls (docs/tools.md). Two formats (:class:`ToolFormat`):

- ``prompt`` (a chat template without tool support, such as SmolLM2's): the tools are listed as
  JSON inside ``<tools>...</tools>`` in a tool prompt appended to the agent's final message,
  after the invocation point, so the shared context renders the same whatever tools an agent
  has; a call is ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``.
- ``template`` (a template that renders ``tools`` and writes calls in ``<tool_call>`` blocks, as
  Qwen2.5, Qwen3 and Hermes do): the template itself renders the tools, the earlier calls and the
  results, where the model was trained to read them; a call is one
  ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` block per call.

>>> tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
>>> calls = parse_tool_calls('<tool_call>[{"name": "add", "arguments": {"a": 1}}]</tool_call>', "chatcmpl-1")
>>> calls[0]["function"], calls[0]["id"] == call_id("chatcmpl-1", 0)
({'name': 'add', 'arguments': '{"a": 1}'}, True)
>>> parse_tool_calls("just text", "chatcmpl-1") is None
True
>>> could_be_call("<tool_c"), could_be_call("Hello")
(True, False)
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from agentshare.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ConstraintSpec,
    NamedToolChoice,
    Tool,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + "(.*?)" + re.escape(CLOSE), re.DOTALL)

TOOL_PROMPT = (
    "\n\nYou have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "To call tools, answer only with a list of calls in this exact form:\n"
    '<tool_call>[{{"name": "tool name", "arguments": {{"argument": "value"}}}}]</tool_call>\n'
    "If no tool is needed, or a tool result above already answers the question, answer in plain text."
)
RESULT_PROMPT = "\n\nAnswer the question using the tool results above."


class ToolFormat(StrEnum):
    """How a model is told about tools and writes its calls (see the module's docstring)."""

    PROMPT = "prompt"
    TEMPLATE = "template"


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's own chat template renders ``tools``."""
    source = getattr(tokenizer, "chat_template", None)
    return isinstance(source, str) and "tools" in source


def tool_format(tokenizer: Any) -> ToolFormat:
    """``template`` when the chat template renders ``tools`` and writes calls as ``<tool_call>``
    blocks (the format the grammar and the parser know); ``prompt`` otherwise, also for templates
    with another call syntax (those models still get the documented tool prompt).

    >>> class Tok: chat_template = "{% for tool in tools %}...{% endfor %}<tool_call>"
    >>> tool_format(Tok()), tool_format(object())
    (<ToolFormat.TEMPLATE: 'template'>, <ToolFormat.PROMPT: 'prompt'>)
    """
    if template_supports_tools(tokenizer) and OPEN in tokenizer.chat_template:
        return ToolFormat.TEMPLATE
    return ToolFormat.PROMPT


def active_tools(body: ChatCompletionRequest) -> list[Tool]:
    """The tools the model is told about: none for ``tool_choice="none"``, the named one for a
    named choice, else all of them."""
    tools = body.tools or []
    if body.tool_choice == "none":
        return []
    if isinstance(body.tool_choice, NamedToolChoice):
        return [t for t in tools if t.function.name == body.tool_choice.function.name]
    return list(tools)


def listed_tools(body: ChatCompletionRequest, fmt: ToolFormat) -> list[Tool]:
    """The tools the prompt lists: :func:`active_tools`, except that the ``template`` format lists
    every tool for a named choice too (its tools come before the shared context, which then stays
    the same for agents that name different tools; the grammar still holds the named one)."""
    if fmt is ToolFormat.TEMPLATE and body.tool_choice != "none":
        return list(body.tools or [])
    return active_tools(body)


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The JSON shape of one tool's function definition as listed in the prompt."""
    f = tool.function
    out: dict[str, Any] = {"name": f.name}
    if f.description:
        out["description"] = f.description
    out["parameters"] = f.parameters or {"type": "object", "properties": {}}
    return out


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The ``tools=`` a chat template reads: OpenAI's function definitions."""
    return [{"type": "function", "function": tool_schema(t)} for t in tools]


def render_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool], *, native: bool) -> list[dict[str, Any]]:
    """Template messages of a chat request.

    ``native=False`` (the ``prompt`` format): assistant tool calls as their ``<tool_call>`` text,
    tool results as role ``tool``, and the tool prompt appended to the final message.
    ``native=True`` (the ``template`` format): assistant ``tool_calls`` and ``tool`` messages are
    handed to the template as OpenAI shapes it reads (arguments parsed), and nothing is added.

    >>> m = [ChatMessage(role="user", content="2+3?"),
    ...      ChatMessage(role="assistant", tool_calls=[{"id": "c", "function": {"name": "add", "arguments": '{"a": 2}'}}]),
    ...      ChatMessage(role="tool", content="5", tool_call_id="c")]
    >>> [r["content"] for r in render_messages(m, [], native=False)]
    ['2+3?', '<tool_call>[{"name": "add", "arguments": {"a": 2}}]</tool_call>', '5\\n\\nAnswer the question using the tool results above.']
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = m.as_template_message()
        if native:
            if m.role == "assistant" and m.tool_calls:
                d["tool_calls"] = [{"type": "function", "id": c.id, "function": {
                    "name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}} for c in m.tool_calls]
            if m.role == "tool" and m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
        elif m.role == "assistant" and m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _loads_or_text(c.function.arguments)} for c in m.tool_calls]
            d["content"] = (d["content"] + "\n" if d["content"] else "") + OPEN + json.dumps(calls) + CLOSE
        out.append(d)
    if out and not native:
        last = messages[-1]
        if tools:
            out[-1]["content"] += TOOL_PROMPT.format(tools=json.dumps([tool_schema(t) for t in tools]))
        if last.role == "tool":
            out[-1]["content"] += RESULT_PROMPT
    return out


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def constraint_of(body: ChatCompletionRequest, fmt: ToolFormat = ToolFormat.PROMPT) -> ConstraintSpec | None:
    """The constraint a request's ``tool_choice`` / ``response_format`` puts on its output, with
    calls written in ``fmt``.

    >>> b = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
    ...     tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required")
    >>> print(constraint_of(b).value.splitlines()[0])
    start: "<tool_call>[" call ("," call)* "]</tool_call>"
    >>> print(constraint_of(b, ToolFormat.TEMPLATE).value.splitlines()[0])
    start: block ("\\n" block)*
    """
    tools = active_tools(body)
    if tools:
        return ConstraintSpec(kind="lark", value=call_grammar(
            tools, parallel=body.parallel_tool_calls, or_text=body.tool_choice in (None, "auto"), fmt=fmt))
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return ConstraintSpec(kind="json_object")
    assert rf.json_schema is not None
    return ConstraintSpec(kind="json_schema",
                          value=json.dumps(rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}))


def call_grammar(tools: Sequence[Tool], *, parallel: bool, or_text: bool = False,
                 fmt: ToolFormat = ToolFormat.PROMPT) -> str:
    """A grammar (llguidance's Lark dialect) for the calls of ``fmt``: ``<tool_call>[call, ...]</tool_call>``
    (``prompt``) or one ``<tool_call>\\ncall\\n</tool_call>`` block per call, a newline between
    them (``template``). Each call is ``{"name": <a tool>, "arguments": <its parameters>}``; one
    call only unless ``parallel``; with ``or_text``, plain text that does not start with ``<`` is
    allowed instead."""
    schema = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t.function.name},
        "arguments": t.function.parameters or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools],
        "x-guidance": {"whitespace_flexible": False}}  # compact: free whitespace could run to max_tokens
    if fmt is ToolFormat.TEMPLATE:
        calls = 'block ("\\n" block)*' if parallel else "block"
        lines = [f"start: {calls}", f'block: "{OPEN}\\n" call "\\n{CLOSE}"']
    else:
        calls = 'call ("," call)*' if parallel else "call"
        lines = [f'start: "{OPEN}[" {calls} "]{CLOSE}"']
    lines.append(f"call: %json {json.dumps(schema)}")
    if or_text:
        lines[0] = f"start: TEXT | {lines[0].removeprefix('start: ')}"
        lines.append(r"TEXT: /[^<\s][^\x00]*/")
    return "\n".join(lines)


def call_id(request_id: str, index: int) -> str:
    """A stable id for call ``index`` of a request (the same in whole and streamed responses)."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


def parse_tool_calls(text: str, request_id: str) -> list[dict[str, Any]] | None:
    """OpenAI ``tool_calls`` of an output made of ``<tool_call>`` blocks only (each a call or a
    list of calls: either format), else ``None``.

    >>> [c["function"]["name"] for c in parse_tool_calls(
    ...     '<tool_call>\\n{"name": "a", "arguments": {}}\\n</tool_call>\\n<tool_call>{"name": "b"}</tool_call>', "r")]
    ['a', 'b']
    >>> parse_tool_calls('<tool_call>{"name": "a"}</tool_call> and text', "r") is None
    True
    """
    body = text.strip()
    blocks = _BLOCK.findall(body)
    if not blocks or _BLOCK.sub("", body).strip():
        return None
    parsed: list[Any] = []
    for block in blocks:
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            return None
        parsed += value if isinstance(value, list) else [value]
    if not parsed:
        return None
    out = []
    for i, c in enumerate(parsed):
        if not (isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict)):
            return None
        out.append({"id": call_id(request_id, i), "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}))}})
    return out


def could_be_call(text: str) -> bool:
    """Whether streamed output so far may still become a tool call (so it is held back)."""
    s = text.lstrip()
    return OPEN.startswith(s) or s.startswith(OPEN)
