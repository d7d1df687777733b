import json
import random

import pytest

from server.training.tasks import (
    TASKS,
    Difficulty,
    generate,
    main,
    records,
    retrieval_error,
    scenario,
    score,
    split,
)


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


@pytest.mark.parametrize("n", [4, 8, 16])
def test_role_team_key_needs_both_attributes(n):
    for row in generate("retrieval", 40, seed=2, difficulty=Difficulty(records=n, key="role+team")):
        table = records(row["context"])
        assert len(table) == n
        q = row["instruction"]
        field, rest = q.removeprefix("What is the ").split(" of the ", 1)
        role, team = rest.split("?")[0].split(" in team ")
        matches = [r for r in table if r["role"] == role and r["team"] == team]
        assert len(matches) == 1 and matches[0][field] == row["response"]
        # neither attribute alone singles the record out
        assert sum(r["role"] == role for r in table) > 1 and sum(r["team"] == team for r in table) > 1


def test_key_knob_is_checked_and_reaches_the_command_line(tmp_path):
    with pytest.raises(ValueError, match="key must be one of name, role\\+team"):
        Difficulty(key="city")
    with pytest.raises(ValueError, match="at least 4 records"):
        Difficulty(records=3, key="role+team")
    main(["retrieval", "--train", "2", "--held-out", "1", "--out", str(tmp_path), "--key", "role+team"])
    row = json.loads((tmp_path / "retrieval-train.jsonl").read_text().splitlines()[0])
    assert " in team " in row["instruction"]
    # the default key draws exactly what it drew before the knob existed (recorded fidelity data sets)
    first = generate("retrieval", 1, seed=1)[0]
    assert (first["instruction"], first["response"]) == ("What is the age of Lena Fox? Answer with the value only.", "45")


def test_retrieval_errors_are_classified_by_the_record_they_come_from():
    row = generate("retrieval", 1, seed=5, difficulty=Difficulty(records=8))[0]
    field = row["instruction"].removeprefix("What is the ").split(" of ", 1)[0]
    table = records(row["context"])
    other = next(r[field] for r in table if r[field] != row["response"])
    assert retrieval_error(row, row["response"]) == ""
    assert retrieval_error(row, other) == "other row"
    assert retrieval_error(row, "nowhere") == "not in the table"
    seen = set()
    for row in generate("retrieval", 30, seed=5, difficulty=Difficulty(records=8, key="role+team")):
        q = row["instruction"]
        field = q.removeprefix("What is the ").split(" of ", 1)[0]
        role, team = q.split(" of the ", 1)[1].split("?")[0].split(" in team ")
        for r in records(row["context"]):
            if r[field] == row["response"]:
                continue
            kind = retrieval_error(row, r[field])
            seen.add(kind)
            holders = [x for x in records(row["context"]) if x[field] == r[field]]
            if any(x["role"] == role for x in holders):
                assert kind == "row with the role"
            elif any(x["team"] == team for x in holders):
                assert kind == "row with the team"
            else:
                assert kind == "row with neither"
    assert seen == {"row with the role", "row with the team", "row with neither"}
