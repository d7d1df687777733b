"""The task families: reproducible, answerable from the context alone, varied, and valid rows."""

import json
import re

import pytest

from server.training import families
from server.training.dataset import parse_row
from server.training.families import FAMILIES, LM, TEAM, generate, mixture, score


@pytest.mark.parametrize("family", [*FAMILIES, LM])
def test_every_family_makes_valid_reproducible_varied_rows(family):
    rows = generate(family, 40, seed=7)
    assert rows == generate(family, 40, seed=7)
    assert rows != generate(family, 40, seed=8)  # another seed, other rows (the held-out split's)
    for i, row in enumerate(rows):
        ex = parse_row(row, line=i + 1)
        assert ex.task == family and row["response"].strip() == row["response"]
    assert len({r["context"] for r in rows}) == 40  # each row its own context
    assert len({r["response"] for r in rows}) >= 3  # not one constant answer


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("counting", "arithmetic", "tool")])
def test_the_answer_is_read_from_the_context(family):
    for row in generate(family, 30, seed=1):
        assert row["response"] in row["context"], (family, row)


def test_counting_and_arithmetic_answers_are_right():
    for row in generate("counting", 30, seed=2):
        colour = re.search(r"How many (\w+) things", row["instruction"]).group(1)
        assert int(row["response"]) == sum(f" {colour} " in line for line in row["context"].splitlines())
    for row in generate("arithmetic", 30, seed=2):
        env: dict = {}
        exec(row["context"].removeprefix("Program:\n"), {}, env)  # the program is Python, too
        var = re.search(r"what is (\w+)\?", row["instruction"]).group(1)
        assert str(env[var]) == row["response"]


def test_tracking_follows_the_object_to_its_last_holder():
    for row in generate("tracking", 30, seed=3):
        last = re.findall(r"(?:gave the \w+ to (\w+)|(\w+) took the)", row["context"])
        assert (last[-1][0] or last[-1][1]) == row["response"]


def test_scores_and_the_mixture():
    assert score("tool", '{"a": 1}', '{ "a":1 }') and score("lookup", " mug\n", "mug")
    assert not score("counting", "3", "4")
    mix = mixture(["lookup", "counting", LM], 5, seed=0)
    assert len(mix) == 15 and {r["task"] for r in mix} == {"lookup", "counting", LM}
    assert set(TEAM) <= set(FAMILIES)
    with pytest.raises(ValueError, match="unknown family 'nope'"):
        generate("nope", 1)


def test_the_command_writes_train_and_held_out_rows(tmp_path, capsys):
    families.main(["counting", "--train", "6", "--held-out", "3", "--out", str(tmp_path)])
    train = [json.loads(x) for x in (tmp_path / "counting-train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (tmp_path / "counting-heldout.jsonl").read_text().splitlines()]
    assert (len(train), len(held)) == (6, 3) and not {r["context"] for r in train} & {r["context"] for r in held}
    assert "wrote 6 rows" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        families.main(["nope"])
