import json

import pytest

from server.prompt import Placement, chat_prompt
from server.training.dataset import DataError, check_family, collate, encode, parse_row, read_jsonl
from server.training.tasks import generate

GOOD = {"context": "a shared document", "instruction": "what?", "response": "that"}


def write(tmp_path, rows):
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"instruction": "q", "response": "a"}, "missing field 'context'"),
        ({"context": "c", "response": "a"}, "missing field 'instruction'"),
        ({"context": "c", "instruction": "q"}, "missing field 'response'"),
        ({**GOOD, "response": "  "}, "field 'response' is empty"),
        ({**GOOD, "instruction": ""}, "field 'instruction' is empty"),
        ({**GOOD, "response": 3}, "field 'response' must be a string"),
        ({**GOOD, "context": [{"role": "user"}]}, "field 'context' must be"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_rows_name_their_line_and_field(tmp_path, bad, message):
    path = write(tmp_path, [GOOD, GOOD, bad])
    with pytest.raises(DataError, match=message) as err:
        read_jsonl(path)
    assert "data.jsonl:3:" in str(err.value)


def test_blank_lines_keep_line_numbers(tmp_path):
    path = write(tmp_path, [GOOD, "", {**GOOD, "response": ""}])
    with pytest.raises(DataError, match=r"data.jsonl:3: field 'response'"):
        read_jsonl(path)


def test_empty_or_missing_files(tmp_path):
    with pytest.raises(DataError, match="empty"):
        read_jsonl(write(tmp_path, [""]))
    with pytest.raises(DataError, match="no such data file"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_over_long_example_names_its_line(tmp_path, smollm2_tokenizer):
    rows = read_jsonl(write(tmp_path, [GOOD, {**GOOD, "context": "word " * 500}]))
    with pytest.raises(DataError, match=r"data.jsonl:2: the example is \d+ tokens long, over the limit of 256"):
        encode(rows, smollm2_tokenizer, max_length=256)


def test_wrong_family_names_its_line(tmp_path):
    rows = read_jsonl(write(tmp_path, [{**GOOD, "family": "a" * 64}, {**GOOD, "family": "b" * 64}]))
    with pytest.raises(DataError, match=r"data.jsonl:2: field 'family'"):
        check_family(rows, "a" * 64)


@pytest.mark.parametrize("placement", list(Placement))
def test_training_ip_is_the_serving_ip(smollm2_tokenizer, placement):
    row = generate("tool", 1)[0]
    (enc,) = encode([parse_row(row)], smollm2_tokenizer, placement=placement)
    served = chat_prompt(smollm2_tokenizer, [{"role": "user", "content": row["context"]}],
                         [{"role": "user", "content": row["instruction"]}])
    assert enc.ids[: len(served.token_ids)] == served.token_ids
    assert enc.ip == served.invocation_point(placement)
    assert enc.response_start == len(served.token_ids)
    assert enc.ids[-1] == smollm2_tokenizer.eos_token_id
    assert smollm2_tokenizer.decode(enc.ids[enc.response_start:-1]) == row["response"]


def test_collate_puts_every_response_token_in_the_labels(smollm2_tokenizer):
    rows = [parse_row(r) for r in generate("retrieval", 3) + generate("tool", 2)]
    items = encode(rows, smollm2_tokenizer)
    for split in (True, False):
        b = collate(items, 0, split=split)
        P = b.prefix_len
        for r, it in enumerate(items):
            want = list(it.ids[it.response_start:])
            got = [t for t in b.labels[r].tolist() if t != -100]
            assert got == want
            real = b.input_ids[r][b.attention_mask[r].bool()].tolist()
            assert real == list(it.ids)
            assert b.attention_mask[r, :P].sum() == (it.ip if split else 0)
