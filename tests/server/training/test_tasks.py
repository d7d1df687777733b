import json
import random

import pytest

from server.training.tasks import TASKS, Difficulty, generate, main, scenario, score, split


@pytest.mark.parametrize("task", TASKS)
def test_generation_is_deterministic_and_seeded(task):
    assert generate(task, 5, seed=3) == generate(task, 5, seed=3)
    assert generate(task, 5, seed=3) != generate(task, 5, seed=4)


def test_three_tasks_share_one_context():
    s = scenario(random.Random(0))
    rows = [s.example(t) for t in TASKS]
    assert len({r["context"] for r in rows}) == 1
    assert len({r["instruction"] for r in rows}) == 3


def test_answers_come_from_the_context():
    for row in generate("retrieval", 20, seed=0):
        assert f" {row['response']} |" in row["context"]
    for row in generate("planning", 20, seed=0):
        assert f"= {row['response']}\n" in row["context"]
    for row in generate("tool", 20, seed=0):
        call = json.loads(row["response"])
        schema = next(json.loads(line) for line in row["context"].splitlines()
                      if line.startswith("{") and json.loads(line)["name"] == call["name"])
        assert list(call["arguments"]) == schema["parameters"]


def test_difficulty_knobs_change_the_context():
    small = generate("retrieval", 1, difficulty=Difficulty(records=2, chains=1, chain_length=2, tools=1))
    large = generate("retrieval", 1, difficulty=Difficulty(records=20, chains=4, chain_length=5, tools=6))
    assert small[0]["context"].count("\n|") == 2 + 2  # header, rule, 2 records
    assert len(large[0]["context"]) > 3 * len(small[0]["context"])
    with pytest.raises(ValueError, match="records"):
        Difficulty(records=0)


def test_planning_chain_is_followed():
    row = generate("planning", 1, difficulty=Difficulty(chains=1, chain_length=4))[0]
    assigns = dict(line.split(" = ") for line in row["context"].split("## Variables\n")[1]
                   .split("\n\n")[0].splitlines())
    var = row["instruction"].split("value of ")[1].split("?")[0]
    while not assigns[var].isdigit():
        var = assigns[var]
    assert assigns[var] == row["response"]


def test_scoring():
    assert score("retrieval", " Oslo\n", "Oslo") and not score("retrieval", "Oslo.", "Oslo")
    assert score("tool", '{"arguments": {"a": 2}, "name": "f"}', '{"name": "f", "arguments": {"a": 2}}')
    assert not score("tool", '{"name": "f", "arguments": {"a": "2"}}', '{"name": "f", "arguments": {"a": 2}}')
    assert not score("tool", "not json", '{"name": "f"}')


def test_held_out_split_is_disjoint():
    train, held = split(list(range(100)), 30, seed=1)
    assert len(held) == 30 and not set(train) & set(held)


def test_command_line_writes_both_splits(tmp_path):
    main(["planning", "--train", "4", "--held-out", "2", "--out", str(tmp_path), "--chains", "2"])
    train = (tmp_path / "planning-train.jsonl").read_text().splitlines()
    held = (tmp_path / "planning-heldout.jsonl").read_text().splitlines()
    assert len(train) == 4 and len(held) == 2 and not set(train) & set(held)
