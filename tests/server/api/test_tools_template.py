"""The ``template`` tool format: a model whose chat template renders ``tools`` and writes calls in
``<tool_call>`` blocks (Qwen's and Hermes' convention) gets the tools, its earlier calls and the
results from its own template, and its calls are constrained and parsed in that form; against the
real server on a tiny model with such a template."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentshare.protocol import ChatCompletionRequest, ChatMessage, Tool
from server.api.config import ServerConfig
from server.api.prompts import chat_request_prompt
from server.api.tools import (
    ToolFormat,
    call_grammar,
    listed_tools,
    parse_tool_calls,
    render_messages,
    template_tools,
    tool_format,
)
from server.engine.build import load_engine
from server.engine.core import EngineConfig
from tests.server.api.test_tool_format import ADD, _accepts
from tests.server.api.test_tools import SCHEMA, valid, whole
from tests.server.helpers import running_server

# A template in the style of Qwen2.5's (written for these tests): the tools in a system block,
# calls as <tool_call> blocks, consecutive tool results joined into one user turn.
HERMES = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each call, answer <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MUL = {"type": "function", "function": {"name": "mul", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}}
CALLS = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
         {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 4, "b": 1}'}}]
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "shared report " * 8},
    {"role": "user", "content": "What are 2 + 3 and 4 + 1?"},
    {"role": "assistant", "content": "", "tool_calls": CALLS},
    {"role": "tool", "content": "5", "tool_call_id": "c1"},
    {"role": "tool", "content": "5", "tool_call_id": "c2"},
]


@pytest.fixture(scope="module")
def hermes_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with the template above."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-hermes")
    for f in tiny_model_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = HERMES
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok(hermes_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hermes_dir)


@pytest.fixture(scope="module")
def hermes_url(hermes_dir: Path) -> Iterator[str]:
    core = load_engine(hermes_dir, dtype="float32", config=EngineConfig(kv_cache_bytes=16 << 20))
    with running_server(core, ServerConfig(kv_cache_bytes=16 << 20, default_max_tokens=16)) as url:  # type: ignore[call-arg]
        yield url


def messages(raw: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def test_the_format_follows_the_template(tok: Any, smollm2_tokenizer: Any) -> None:
    assert tool_format(tok) is ToolFormat.TEMPLATE
    assert tool_format(smollm2_tokenizer) is ToolFormat.PROMPT  # no tool support: the documented prompt


def test_the_prompt_is_the_templates_own_rendering(tok: Any) -> None:
    tools = [Tool.model_validate(ADD)]
    p = chat_request_prompt(tok, messages(CONVERSATION), tools)
    raw = copy.deepcopy(CONVERSATION)
    for m in raw:  # the template reads arguments as objects
        for c in m.get("tool_calls", []):
            c["function"] = {**c["function"], "arguments": json.loads(c["function"]["arguments"])}
    want = tok.apply_chat_template(raw, tools=template_tools(tools), tokenize=False, add_generation_prompt=True)
    assert p.token_ids == tuple(tok.encode(want, add_special_tokens=False))
    text = tok.decode(p.token_ids)
    assert text.count("<tool_response>") == 2 and "# Tools" in text and '"name": "add"' in text
    # the final turn is the two tool results together (one user block); everything before is context
    final = tok.decode(p.token_ids[p.turn_start:p.header_start])
    assert final.startswith("<|im_start|>user<tool_response>") and final.count("<tool_response>") == 2
    before = tok.apply_chat_template(raw[:-2], tools=template_tools(tools), tokenize=False)
    assert p.context_len == p.turn_start == len(tok.encode(before, add_special_tokens=False))


def test_agents_with_the_same_tools_share_the_context(tok: Any) -> None:
    """The template puts the tools first, so agents share the context's prefill only when they
    list the same tools (docs/tools.md); the prompt format keeps them after the invocation point."""
    tools = [Tool.model_validate(ADD)]
    ctx = CONVERSATION[:2]
    a = chat_request_prompt(tok, messages([*ctx, {"role": "user", "content": "First agent."}]), tools)
    b = chat_request_prompt(tok, messages([*ctx, {"role": "user", "content": "Second agent."}]), tools)
    assert a.context_len == b.context_len > 0 and a.token_ids[:a.context_len] == b.token_ids[:b.context_len]
    other = Tool.model_validate({"type": "function", "function": {"name": "mul"}})
    c = chat_request_prompt(tok, messages([*ctx, {"role": "user", "content": "First agent."}]), [other])
    assert c.token_ids[:c.context_len] != a.token_ids[:a.context_len]


ONE = '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>'
TWO = ONE + "\n" + ONE.replace("2", "4")


@pytest.mark.parametrize(("parallel", "or_text", "text", "ok"), [
    (False, False, ONE, True),
    (False, False, TWO, False),  # one call only
    (True, False, TWO, True),
    (True, False, ONE + ONE, False),  # blocks are separated by a newline
    (True, False, '<tool_call>[{"name":"add","arguments":{"a":2,"b":3}}]</tool_call>', False),  # the prompt format
    (True, False, ONE.replace("\n{", "{"), False),
    (True, True, "plain text", True),
    (True, True, TWO, True),
    (False, False, "plain text", False),
])
def test_the_grammar_holds_the_templates_call_blocks(parallel: bool, or_text: bool, text: str, ok: bool) -> None:
    grammar = call_grammar([Tool.model_validate(ADD)], parallel=parallel, or_text=or_text, fmt=ToolFormat.TEMPLATE)
    assert _accepts(grammar, text) is ok


def test_template_blocks_parse_as_calls() -> None:
    calls = parse_tool_calls(TWO, "r")
    assert calls is not None and [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"a": 2, "b": 3}, {"a": 4, "b": 3}]
    assert len({c["id"] for c in calls}) == 2


def test_a_named_choice_still_lists_every_tool() -> None:
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [ADD, MUL],
        "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert [t.function.name for t in listed_tools(body, ToolFormat.TEMPLATE)] == ["add", "mul"]
    assert [t.function.name for t in listed_tools(body, ToolFormat.PROMPT)] == ["add"]
    assert listed_tools(body.model_copy(update={"tool_choice": "none"}), ToolFormat.TEMPLATE) == []


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_the_server_calls_in_the_templates_format(hermes_url: str, choice: object) -> None:
    tools = [ADD] if choice == "required" else [MUL, ADD]  # named: the grammar holds the named one
    res = whole(hermes_url, {"model": "base", "messages": [{"role": "user", "content": "2 + 3?"}],
                             "tools": tools, "tool_choice": choice, "temperature": 0, "max_tokens": 64})
    c = res.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls, c
    for call in c.message.tool_calls:
        assert call.function.name == "add" and valid(json.loads(call.function.arguments), SCHEMA)  # type: ignore[union-attr]


def test_the_server_reads_a_history_of_calls_and_results(hermes_url: str) -> None:
    res = whole(hermes_url, {"model": "base", "messages": CONVERSATION[1:], "tools": [ADD], "temperature": 0,
                             "max_tokens": 8})
    assert res.usage is not None and res.usage.prompt_tokens > 40
    assert res.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_native_messages_carry_the_openai_shapes() -> None:
    """What the template is handed: calls with type, id and parsed arguments; results with their id;
    plain messages untouched; no tool prompt appended."""
    raw = [*CONVERSATION[1:3], {"role": "assistant", "content": "Let me add."}, *CONVERSATION[3:]]
    out = render_messages(messages(raw), [Tool.model_validate(ADD)], native=True)
    assert out[0] == CONVERSATION[1] and out[2] == {"role": "assistant", "content": "Let me add."}
    assert out[3] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "c1", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
        {"type": "function", "id": "c2", "function": {"name": "add", "arguments": {"a": 4, "b": 1}}}]}
    assert out[4] == {"role": "tool", "content": "5", "tool_call_id": "c1"}
    assert template_tools([Tool.model_validate(ADD)]) == [{"type": "function", "function": {
        "name": "add", "description": "Add two integers", "parameters": ADD["function"]["parameters"]}}]
    bare = render_messages(messages([{"role": "tool", "content": "5"}]), [], native=True)
    assert bare == [{"role": "tool", "content": "5"}]  # no id given: none invented
