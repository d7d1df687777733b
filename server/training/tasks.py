"""An offline generator of agent tasks over one shared context, and their scoring.

Each *scenario* is one shared context (the document every agent reads) holding three sections:
a table of records, a list of variable assignments, and a set of tool schemas. Three agents ask
about it, one task each:

- ``retrieval``: the value of one field of one record (exact match);
- ``planning``: the value at the end of a chain of assignments (exact match);
- ``tool``: a JSON tool call matching one of the schemas (compared as parsed JSON).

Difficulty knobs (:class:`Difficulty`): number of records, how the question names its record
(by name, or by two attributes that only together single it out), chain length and number of
chains, number of tools. Examples are rows ``{"context", "instruction", "response", "task"}`` — the
JSONL format :mod:`server.training.dataset` reads.

>>> rows = generate("retrieval", 3, seed=1)
>>> len(rows), sorted(rows[0])
(3, ['context', 'instruction', 'response', 'task'])
>>> rows == generate("retrieval", 3, seed=1)       # deterministic
True
>>> score("tool", '{"name": "f", "arguments": {"a": 1}}', '{"arguments":{"a":1},"name":"f"}')
True
>>> score("retrieval", "Paris", " Paris\\n")
True
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TASKS = ("retrieval", "planning", "tool")
KEYS = ("name", "role+team")
USAGE = """Write train/held-out JSONL files of one task:

    python -m server.training.tasks retrieval --train 1000 --held-out 300 --records 8 --out data/
"""

_FIRST = ("Ada", "Boris", "Chen", "Dara", "Elif", "Femi", "Gita", "Hugo", "Ines", "Jonas", "Kiri",
          "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tomas", "Uma",
          "Vera", "Wei", "Xena", "Yusuf", "Zoe")
_LAST = ("Abe", "Berg", "Costa", "Diaz", "Egan", "Fox", "Gray", "Hale", "Ito", "Jain", "Kim",
         "Lund", "Moss", "Noor", "Ortiz", "Park", "Reed", "Sato", "Tran", "Vogel", "Wolf", "Young")
_CITY = ("Lisbon", "Oslo", "Lagos", "Quito", "Hanoi", "Perth", "Riga", "Tunis", "Lima", "Cork",
         "Bern", "Accra", "Dakar", "Split", "Turku", "Nara", "Porto", "Graz", "Minsk", "Sofia")
_ROLE = ("chemist", "pilot", "nurse", "baker", "judge", "welder", "editor", "tailor", "farmer",
         "dentist", "plumber", "painter", "cashier", "surveyor", "librarian", "geologist")
_FIELDS = ("city", "role", "age", "team")
_TEAM = ("red", "blue", "green", "amber", "teal", "violet", "coral", "olive")
_VARS = tuple("abcdefghjkmnpqrstuvwxyz")

# tool templates: name choices, description, and parameters as (name choices, value kind)
_TOOLS: tuple[tuple[tuple[str, ...], str, tuple[tuple[tuple[str, ...], str], ...]], ...] = (
    (("get_weather", "weather_lookup", "forecast"), "get the weather forecast for a city",
     ((("city", "location", "place"), "city"), (("days", "n_days", "horizon"), "int"))),
    (("send_email", "mail_send", "email_user"), "send an email to a person",
     ((("to", "recipient", "person"), "person"), (("subject", "topic", "title"), "word"))),
    (("book_table", "reserve_table", "restaurant_booking"), "book a restaurant table",
     ((("guests", "party_size", "people"), "int"), (("city", "town", "where"), "city"))),
    (("convert_currency", "fx_convert", "exchange"), "convert an amount of money",
     ((("amount", "value", "sum"), "int"), (("currency", "target", "to_currency"), "currency"))),
    (("create_task", "add_todo", "new_ticket"), "create a task for a person",
     ((("assignee", "owner", "user"), "person"), (("priority", "level", "urgency"), "int"))),
    (("search_flights", "find_flight", "flight_search"), "search for flights to a city",
     ((("destination", "dest", "arrival"), "city"), (("passengers", "seats", "travellers"), "int"))),
)
_CURRENCY = ("EUR", "USD", "JPY", "GBP", "CHF", "NOK", "INR", "BRL")
_WORDS = ("budget", "launch", "invoice", "meeting", "holiday", "review", "contract", "survey")


@dataclass(frozen=True, slots=True)
class Difficulty:
    """Size of a scenario: more records, longer/more chains and more tools are harder (and longer).

    ``key``: how a retrieval question names its record — ``"name"`` (its unique name) or
    ``"role+team"`` (its role and team: each is shared with another record, only the pair is
    unique, so the lookup needs both).

    >>> Difficulty().records, Difficulty(records=4).records
    (10, 4)
    """

    records: int = 10
    chains: int = 3
    chain_length: int = 3
    tools: int = 4
    key: str = "name"

    def __post_init__(self) -> None:
        if not (1 <= self.records <= len(_FIRST)):
            raise ValueError(f"records must be in 1..{len(_FIRST)}, got {self.records}")
        if not (1 <= self.chains and 1 <= self.chain_length and self.chains * self.chain_length <= len(_VARS)):
            raise ValueError(f"chains x chain_length must be in 1..{len(_VARS)} variables")
        if not (1 <= self.tools <= len(_TOOLS)):
            raise ValueError(f"tools must be in 1..{len(_TOOLS)}, got {self.tools}")
        if self.key not in KEYS:
            raise ValueError(f"key must be one of {', '.join(KEYS)}, got {self.key!r}")
        if self.key == "role+team" and self.records < 4:
            raise ValueError(f"key 'role+team' needs at least 4 records, got {self.records}")


@dataclass(frozen=True, slots=True)
class Scenario:
    """One shared context and the three agents' (instruction, response) pairs over it."""

    context: str
    questions: dict[str, tuple[str, str]]

    def example(self, task: str) -> dict[str, str]:
        instruction, response = self.questions[task]
        return {"task": task, "context": self.context, "instruction": instruction, "response": response}


def scenario(rng: random.Random, difficulty: Difficulty = Difficulty()) -> Scenario:
    """Draw one scenario (context + one question per task) from ``rng``.

    >>> s = scenario(random.Random(0), Difficulty(records=2, chains=1, chain_length=2, tools=1))
    >>> s.context.splitlines()[0], sorted(s.questions)
    ('## Records', ['planning', 'retrieval', 'tool'])
    """
    table, retrieval = _records(rng, difficulty.records, difficulty.key)
    assigns, planning = _chains(rng, difficulty.chains, difficulty.chain_length)
    tools, tool = _tools(rng, difficulty.tools, table)
    context = "\n".join(["## Records", *table, "", "## Variables", *assigns, "", "## Tools", *tools])
    return Scenario(context, {"retrieval": retrieval, "planning": planning, "tool": tool})


def generate(task: str, n: int, *, seed: int = 0, difficulty: Difficulty = Difficulty()) -> list[dict[str, str]]:
    """``n`` examples of ``task`` (one per fresh scenario), reproducible from ``seed``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    rng = random.Random(f"{task}/{seed}")
    return [scenario(rng, difficulty).example(task) for _ in range(n)]


def split(rows: Sequence[dict[str, Any]], held_out: float, *, seed: int = 0) -> tuple[list, list]:
    """Shuffle and split into (train, held-out); ``held_out`` is a count or a fraction.

    >>> train, test = split(list(range(10)), 0.3)
    >>> len(train), len(test), sorted(train + test) == list(range(10))
    (7, 3, True)
    """
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    k = round(held_out * len(rows)) if isinstance(held_out, float) else int(held_out)
    if not 0 <= k <= len(rows):
        raise ValueError(f"held_out={held_out} is out of range for {len(rows)} rows")
    return rows[: len(rows) - k], rows[len(rows) - k:]


def score(task: str, predicted: str, reference: str) -> bool:
    """Exact match after trimming whitespace; for ``tool``, equality of the parsed JSON."""
    if task == "tool":
        try:
            return json.loads(predicted.strip()) == json.loads(reference)
        except ValueError:
            return False
    return predicted.strip() == reference.strip()


def records(context: str) -> list[dict[str, str]]:
    """The table of a scenario's context, one dict per record (columns name, city, role, age, team)."""
    lines = context.split("## Records\n")[1].split("\n\n")[0].splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]]


def retrieval_error(row: dict[str, str], predicted: str) -> str:
    """What kind of wrong answer ``predicted`` is to retrieval ``row`` ("" when it is right).

    ``other row``: the asked field's value in another record (for a question by role and team:
    ``row with the role`` / ``row with the team`` when that record shares one of them, or
    ``row with neither``); ``not in the table`` otherwise.

    >>> row = generate("retrieval", 1, seed=1)[0]
    >>> retrieval_error(row, row["response"]), retrieval_error(row, "Atlantis")
    ('', 'not in the table')
    """
    if score("retrieval", predicted, row["response"]):
        return ""
    q = row["instruction"]
    field = q.removeprefix("What is the ").split(" of ", 1)[0]
    value = predicted.strip()
    others = [r for r in records(row["context"]) if r.get(field) == value]
    if not others:
        return "not in the table"
    if " in team " not in q:
        return "other row"
    role, team = q.split(" of the ", 1)[1].split("?")[0].split(" in team ")
    if any(r["role"] == role for r in others):
        return "row with the role"
    if any(r["team"] == team for r in others):
        return "row with the team"
    return "row with neither"


def _records(rng: random.Random, n: int, key: str = "name") -> tuple[list[str], tuple[str, str]]:
    # by role+team: roles and teams come from small pools, so each repeats and only pairs single out a row
    roles = _ROLE if key == "name" else rng.sample(_ROLE, max(2, n // 2))
    teams = _TEAM if key == "name" else rng.sample(_TEAM, max(2, min(len(_TEAM), n // 2)))
    while True:
        firsts = rng.sample(_FIRST, n)
        rows = []
        for first in firsts:
            rows.append({"name": f"{first} {rng.choice(_LAST)}", "city": rng.choice(_CITY),
                         "role": rng.choice(roles), "age": str(rng.randint(21, 79)),
                         "team": rng.choice(teams)})
        if key == "name":
            break
        by_role, by_team = Counter(r["role"] for r in rows), Counter(r["team"] for r in rows)
        by_pair = Counter((r["role"], r["team"]) for r in rows)
        keyed = [r for r in rows
                 if by_pair[r["role"], r["team"]] == 1 and by_role[r["role"]] > 1 and by_team[r["team"]] > 1]
        if keyed:
            break
    lines = ["| name | city | role | age | team |", "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['city']} | {r['role']} | {r['age']} | {r['team']} |" for r in rows]
    if key == "name":
        target, field = rng.choice(rows), rng.choice(_FIELDS)
        question = f"What is the {field} of {target['name']}? Answer with the value only."
    else:
        target, field = rng.choice(keyed), rng.choice(("name", "city", "age"))
        question = (f"What is the {field} of the {target['role']} in team {target['team']}? "
                    "Answer with the value only.")
    return lines, (question, target[field])


def _chains(rng: random.Random, chains: int, length: int) -> tuple[list[str], tuple[str, str]]:
    names = rng.sample(_VARS, chains * length)
    steps: list[list[str]] = []
    for c in range(chains):
        chain = names[c * length:(c + 1) * length]
        value = rng.randint(10, 99)
        steps.append([f"{chain[0]} = {value}"] + [f"{chain[i]} = {chain[i - 1]}" for i in range(1, length)])
        if c == 0:
            answer, target = str(value), chain[-1]
    # interleave the chains, keeping each chain's own order
    order = [c for c in range(chains) for _ in range(length)]
    rng.shuffle(order)
    cursor = [0] * chains
    lines = []
    for c in order:
        lines.append(steps[c][cursor[c]])
        cursor[c] += 1
    return lines, (f"What is the value of {target}? Answer with the number only.", answer)


def _tools(rng: random.Random, n: int, table: list[str]) -> tuple[list[str], tuple[str, str]]:
    picked = rng.sample(_TOOLS, n)
    schemas, chosen = [], []
    for names, description, params in picked:
        name = rng.choice(names)
        pnames = [(rng.choice(choices), kind) for choices, kind in params]
        schemas.append(json.dumps({"name": name, "description": description,
                                   "parameters": [p for p, _ in pnames]}))
        chosen.append((name, description, pnames))
    name, description, pnames = rng.choice(chosen)
    people = [line.split("|")[1].strip() for line in table[2:]]
    values = {"int": lambda: rng.randint(2, 9), "city": lambda: rng.choice(_CITY),
              "person": lambda: rng.choice(people), "word": lambda: rng.choice(_WORDS),
              "currency": lambda: rng.choice(_CURRENCY)}
    args = {p: values[kind]() for p, kind in pnames}
    label = {"int": "number", "city": "city", "person": "person", "word": "topic", "currency": "currency"}
    spoken = ", ".join(f"{label[kind]} {v}" for (p, kind), v in zip(pnames, args.values(), strict=True))
    question = f"Call the tool to {description} ({spoken}). Reply with the JSON call only."
    return schemas, (question, json.dumps({"name": name, "arguments": args}))


def main(argv: Sequence[str] | None = None) -> None:
    """Command line of the generator (see ``USAGE``); held-out rows come from their own seed."""
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=TASKS)
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--held-out", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=".")
    for knob, default in ((f.name, f.default) for f in dataclasses.fields(Difficulty)):
        p.add_argument(f"--{knob.replace('_', '-')}", type=type(default), default=default,
                       choices=KEYS if knob == "key" else None)
    a = p.parse_args(argv)
    diff = Difficulty(a.records, a.chains, a.chain_length, a.tools, a.key)
    from pathlib import Path

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for part, n, seed in (("train", a.train, 2 * a.seed), ("heldout", a.held_out, 2 * a.seed + 1)):
        rows = generate(a.task, n, seed=seed, difficulty=diff)
        path = out / f"{a.task}-{part}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
