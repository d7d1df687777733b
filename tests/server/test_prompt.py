import pytest

from server.engine.errors import InvalidRequest
from server.prompt import Placement, chat_prompt, text_prompt

CONTEXT = [{"role": "user", "content": "Here is the shared document: alpha beta gamma."}]
TURN = [{"role": "user", "content": "Which word comes second?"}]


def decode(tok, ids):
    return tok.decode(list(ids))


def test_turn_ip_is_the_first_token_of_the_agents_final_turn(smollm2_tokenizer):
    p = chat_prompt(smollm2_tokenizer, CONTEXT, TURN)
    ip = p.invocation_point(Placement.TURN)
    assert decode(smollm2_tokenizer, p.token_ids[:ip]).endswith("alpha beta gamma.<|im_end|>\n")
    assert decode(smollm2_tokenizer, p.token_ids[ip:]) == (
        "<|im_start|>user\nWhich word comes second?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ip == p.context_len  # a single-message turn starts right after the context


def test_header_ip_is_the_first_token_of_the_generation_prompt(smollm2_tokenizer):
    p = chat_prompt(smollm2_tokenizer, CONTEXT, TURN)
    ip = p.invocation_point(Placement.HEADER)
    assert decode(smollm2_tokenizer, p.token_ids[ip:]) == "<|im_start|>assistant\n"
    assert decode(smollm2_tokenizer, p.token_ids[ip - 1 : ip]) == "\n"


def test_the_shared_context_is_identical_across_agents(smollm2_tokenizer):
    a = chat_prompt(smollm2_tokenizer, CONTEXT, TURN)
    b = chat_prompt(smollm2_tokenizer, CONTEXT, [{"role": "user", "content": "Plan the work."}])
    assert a.token_ids[: a.context_len] == b.token_ids[: b.context_len]
    assert a.token_ids[a.context_len] == b.token_ids[b.context_len]  # both start <|im_start|>


def test_agent_private_history_sits_before_the_ip_of_its_final_turn(smollm2_tokenizer):
    turn = [*TURN, {"role": "assistant", "content": "beta"}, {"role": "user", "content": "Sure?"}]
    p = chat_prompt(smollm2_tokenizer, CONTEXT, turn)
    assert p.context_len < p.turn_start < p.header_start < len(p.token_ids)
    assert decode(smollm2_tokenizer, p.token_ids[p.turn_start : p.header_start]).startswith(
        "<|im_start|>user\nSure?"
    )


def test_text_prompt_boundaries(smollm2_tokenizer):
    p = text_prompt(smollm2_tokenizer, "Shared text.", " Agent question:")
    assert p.context_len == len(smollm2_tokenizer.encode("Shared text.", add_special_tokens=False))
    assert p.invocation_point(Placement.TURN) == p.context_len
    # no header in plain text: the IP is capped at the last prompt token
    assert p.invocation_point(Placement.HEADER) == len(p.token_ids) - 1


@pytest.mark.parametrize(
    "context, turn, msg",
    [
        (CONTEXT, [], "turn is empty"),
        ([{"role": "user"}], TURN, "string 'role' and 'content'"),
        ([{"role": "user", "content": 3}], TURN, "string 'role' and 'content'"),
    ],
)
def test_bad_messages_are_refused(smollm2_tokenizer, context, turn, msg):
    with pytest.raises(InvalidRequest, match=msg):
        chat_prompt(smollm2_tokenizer, context, turn)


def test_empty_text_prompt_is_refused(smollm2_tokenizer):
    with pytest.raises(InvalidRequest, match="empty"):
        text_prompt(smollm2_tokenizer, "", "")


class RewritingTemplate:
    """A template that numbers messages from the end: earlier text changes as messages are added."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        n = len(messages)
        return "".join(f"[{n - i}]{m['content']}" for i, m in enumerate(messages))

    def encode(self, text, add_special_tokens):
        return [ord(c) for c in text]


def test_a_template_that_is_not_prefix_stable_is_refused():
    with pytest.raises(InvalidRequest, match="prefix-stable"):
        chat_prompt(RewritingTemplate(), CONTEXT, TURN)


class ToyTokenizer:
    """A toy template ``<role>content|``; like a Llama tokenizer, ``encode`` adds a BOS (id 0)
    unless told not to."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


def chars(ids):
    return "".join(map(chr, ids))


def test_no_special_tokens_are_added_inside_the_layout():
    p = chat_prompt(ToyTokenizer(), CONTEXT, TURN)
    assert 0 not in p.token_ids  # the template writes every special token itself
    assert chars(p.token_ids) == (f"<user>{CONTEXT[0]['content']}|<user>{TURN[0]['content']}|<assistant>")
    assert text_prompt(ToyTokenizer(), "ab", "cd").token_ids == tuple(map(ord, "abcd"))


def test_text_prompt_without_a_turn_is_all_context_and_without_a_context_all_turn():
    p = text_prompt(ToyTokenizer(), "Shared text.")
    assert chars(p.token_ids) == "Shared text."
    assert p.context_len == p.turn_start == p.header_start == len(p.token_ids)
    q = text_prompt(ToyTokenizer(), "", "Only a question")
    assert chars(q.token_ids) == "Only a question"
    assert (q.context_len, q.turn_start, q.header_start) == (0, 0, len(q.token_ids))
    assert q.invocation_point(Placement.TURN) == 0


def test_chat_prompt_without_a_shared_context_starts_the_turn_at_zero():
    p = chat_prompt(ToyTokenizer(), [], TURN)
    assert (p.context_len, p.turn_start) == (0, 0)
    assert chars(p.token_ids[p.header_start:]) == "<assistant>"
    assert p.invocation_point(Placement.TURN) == 0


class ToolToy:
    """A template that renders ``tools`` first and joins consecutive tool results into one block."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, tools=None):
        assert tokenize is False
        out = f"<tools {','.join(t['name'] for t in tools)}>" if tools else ""
        for i, m in enumerate(messages):
            if m["role"] == "tool":
                first = i == 0 or messages[i - 1]["role"] != "tool"
                last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
                out += ("<results>" if first else "") + m["content"] + ("|" if last else ";")
            else:
                out += f"<{m['role']}>{m['content']}|"
        return out + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens):
        return [ord(c) for c in text]


def test_tools_reach_the_template_and_a_final_turn_may_be_several_messages():
    ctx = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "calls"}]
    results = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    p = chat_prompt(ToolToy(), ctx, results, tools=[{"name": "add"}], final=2)
    text = "".join(map(chr, p.token_ids))
    assert text == "<tools add><user>q|<assistant>calls|<results>1;2|<assistant>"
    assert p.context_len == p.turn_start == len("<tools add><user>q|<assistant>calls|")
    assert "".join(map(chr, p.token_ids[p.turn_start:p.header_start])) == "<results>1;2|"
    assert chat_prompt(ToolToy(), ctx, results[:1], tools=[]).token_ids[0] == ord("<")  # no tools: none listed
    assert "<tools" not in "".join(map(chr, chat_prompt(ToolToy(), ctx, results[:1], tools=[]).token_ids))
    with pytest.raises(InvalidRequest, match="renders the agent's earlier messages differently"):
        chat_prompt(ToolToy(), ctx, results, tools=[{"name": "add"}])  # one at a time: not prefix-stable
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"final={bad} must be within the turn's 2 messages"):
            chat_prompt(ToolToy(), ctx, results, final=bad)
