"""Tool-chat training rows: laid out as the server lays out a chat request with tools, responses
the server's grammar accepts, unseen tools kept out of training, and the scoring."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentshare.protocol import Tool
from server.api.tools import RESULT_PROMPT, TOOL_PROMPT, call_grammar
from server.training import tool_chat
from server.training.dataset import DataError, parse_row, prompt_of
from tests.server.api.test_tool_format import _accepts

ROWS = tool_chat.generate(300, seed=0)


def listed(row: dict[str, Any]) -> list[Tool]:
    text = row["instruction"].split("<tools>")[1].split("</tools>")[0]
    return [Tool.model_validate({"type": "function", "function": f}) for f in json.loads(text)]


def test_rows_are_deterministic_and_mixed() -> None:
    assert tool_chat.generate(300, seed=0) == ROWS != tool_chat.generate(300, seed=1)
    kinds = {k: sum(r["kind"] == k for r in ROWS) for k in tool_chat.KINDS}
    assert all(kinds[k] > 20 for k in tool_chat.KINDS), kinds
    assert len(tool_chat.generate(7)) == 7 and tool_chat.generate(0) == []


def test_every_response_is_what_the_auto_grammar_allows() -> None:
    for row in ROWS:
        grammar = call_grammar(listed(row), parallel=True, or_text=True)
        assert _accepts(grammar, row["response"]), row["response"]


def test_rows_carry_the_servers_tool_prompt_and_results() -> None:
    head = TOOL_PROMPT.split("{tools}")[0]
    for row in ROWS:
        assert head in row["instruction"] and row["task"] == tool_chat.TASK
        if row["kind"] == "answer":
            assert row["role"] == "tool" and row["instruction"].endswith(RESULT_PROMPT)
            assert any(m["role"] == "assistant" and m["content"].startswith("<tool_call>[{") for m in row["context"])
            assert all(res in row["response"] for res in row["results"])
        else:
            assert row["role"] == "user" and head not in "".join(m["content"] for m in row["context"])


def test_unseen_tools_never_reach_training_rows() -> None:
    unseen = {n for k in tool_chat.TOOL_KINDS[-tool_chat.UNSEEN_KINDS:] for n in k.names}
    text = json.dumps(ROWS)
    assert not [n for n in unseen if f'"{n}' in text or f"\\\"{n}\\\"" in text]
    held = tool_chat.generate(40, seed=1, unseen=True)
    called = {json.loads(r["response"][len("<tool_call>"):-len("</tool_call>")])[0]["name"]
              for r in held if r["kind"] == "call"}
    assert called and called <= unseen
    assert "capital_of" not in text  # the ReAct test's tool is never trained on


def test_score() -> None:
    call = next(r for r in ROWS if r["kind"] == "call")
    answer = next(r for r in ROWS if r["kind"] == "answer")
    spaced = json.dumps(json.loads(call["response"][11:-12]))
    assert tool_chat.score(call["response"], call) and tool_chat.score(f"<tool_call>{spaced}</tool_call>", call)
    assert not tool_chat.score("I will call it.", call)
    assert not tool_chat.score(call["response"].replace('"arguments":{', '"arguments":{"x":1,'), call)
    assert tool_chat.score(f"So: {answer['results'][0]} {' '.join(answer['results'][1:])}", answer)
    assert not tool_chat.score("I do not know.", answer)
    assert not tool_chat.score(call["response"], answer)  # calling again is wrong after the results
    assert not tool_chat.score(" ", {"response": "hi", "kind": "direct"})


def test_the_instruction_role_reaches_the_prompt(smollm2_tokenizer: Any) -> None:
    answer = next(r for r in ROWS if r["kind"] == "answer")
    ex = parse_row(answer)
    assert ex.role == "tool"
    text = smollm2_tokenizer.decode(prompt_of(smollm2_tokenizer, ex).token_ids)
    assert "<|im_start|>tool\n" + answer["instruction"][:20] in text
    assert parse_row({"context": "", "instruction": "q", "response": "a"}).role == "user"
    with pytest.raises(DataError, match="field 'role' must be one of 'user', 'tool', got 'assistant'"):
        parse_row({"context": "", "instruction": "q", "response": "a", "role": "assistant"}, line=3)
