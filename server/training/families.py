"""Many task families over a shared context, for a joint prefill that generalises, and for
measuring how a cache-conditioned module does on a family the joint base never saw.

:mod:`server.training.tasks` has the three tasks of the shipped team over one scenario layout.
This module adds families that differ in what the context looks like (a markdown table,
``key: value`` blocks, JSON lines, sentences, a story, a log) and in what the agent does with it
(look a value up, count, copy, extract, follow arithmetic, track an object, call a tool), plus
plain language modelling on real text (``lm``: the standard library's sources).

Every family draws an example from a :class:`random.Random` alone, so rows are reproducible from
(family, seed, index). Answers are short and scored by exact match (``tool``: parsed JSON);
``lm`` rows are for training only (:data:`SCORED` leaves them out).

>>> rows = generate("counting", 2, seed=3)
>>> sorted(rows[0]), rows[0]["task"]
(['context', 'instruction', 'response', 'task'], 'counting')
>>> rows == generate("counting", 2, seed=3)
True
>>> mixture(["lookup", "copying"], 4, seed=0)[0]["task"] in ("lookup", "copying")
True
"""

from __future__ import annotations

import argparse
import json
import random
import string
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from server.training import tasks as team_tasks
from server.training.tasks import _CITY, _FIRST, _LAST, _ROLE, _TEAM, _VARS, Difficulty

Draw = Callable[[random.Random], tuple[str, str, str]]
"""A family: one (context, instruction, response) from a random source."""

_COLOURS = ("red", "blue", "green", "black", "white", "yellow", "grey", "orange")
_ITEMS = ("lamp", "chair", "mug", "kettle", "book", "drill", "bottle", "radio", "clock", "scarf")
_OBJECTS = ("key", "ball", "letter", "coin", "ring", "map", "box", "ticket")
_PLACES = ("kitchen", "garden", "hall", "attic", "garage", "office", "cellar", "porch")
_DOMAINS = ("example.org", "mail.test", "corp.example", "lab.test")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")


def _people(rng: random.Random, n: int) -> list[dict[str, str]]:
    return [{"name": f"{first} {rng.choice(_LAST)}", "city": rng.choice(_CITY), "role": rng.choice(_ROLE),
             "age": str(rng.randint(21, 79)), "team": rng.choice(_TEAM)} for first in rng.sample(_FIRST, n)]


def _ask_field(rng: random.Random, rows: list[dict[str, str]]) -> tuple[dict[str, str], str]:
    return rng.choice(rows), rng.choice(("city", "role", "age", "team"))


def kv_blocks(rng: random.Random) -> tuple[str, str, str]:
    """Records as ``Key: value`` blocks; asked: one field of one person."""
    rows = _people(rng, rng.randint(5, 9))
    blocks = ["\n".join(f"{k.capitalize()}: {v}" for k, v in r.items()) for r in rows]
    target, field = _ask_field(rng, rows)
    return ("Staff directory\n\n" + "\n\n".join(blocks),
            f"Give the {field} listed for {target['name']}. Reply with the value alone.", target[field])


def json_lines(rng: random.Random) -> tuple[str, str, str]:
    """Records as JSON objects, one a line, keys shuffled; asked: one field of one person."""
    rows = _people(rng, rng.randint(5, 9))
    lines = []
    for r in rows:
        keys = list(r)
        rng.shuffle(keys)
        lines.append(json.dumps({k: r[k] for k in keys}))
    target, field = _ask_field(rng, rows)
    return ("records.jsonl:\n" + "\n".join(lines),
            f'In records.jsonl, what is "{field}" for "{target["name"]}"? Output the value only.', target[field])


def prose_records(rng: random.Random) -> tuple[str, str, str]:
    """Records written as sentences in varied word order; asked: where someone lives, and so on."""
    rows = _people(rng, rng.randint(5, 8))
    forms = ("{name} works as a {role} in {city}; {name} is {age} and plays for the {team} team.",
             "Aged {age}, {name} lives in {city} and is a {role} with team {team}.",
             "The {team} team's {role}, {name}, is {age} years old and based in {city}.")
    text = " ".join(rng.choice(forms).format(**r) for r in rows)
    target, field = _ask_field(rng, rows)
    question = {"city": f"In which city is {target['name']} based?",
                "role": f"What job does {target['name']} have?",
                "age": f"How old is {target['name']}?",
                "team": f"Which team is {target['name']} on?"}[field]
    return text, question + " One word or number only.", target[field]


def lookup(rng: random.Random) -> tuple[str, str, str]:
    """A glossary of codes; asked: what one code stands for."""
    n = rng.randint(8, 14)
    codes = rng.sample([a + b + c for a in string.ascii_uppercase for b in string.ascii_uppercase
                        for c in "0123456789"], n)
    words = rng.sample(list(_CITY) + list(_ROLE) + list(_ITEMS), n)
    lines = [f"{c} => {w}" for c, w in zip(codes, words, strict=True)]
    i = rng.randrange(n)
    return "Code table:\n" + "\n".join(lines), f"What does the code {codes[i]} map to? Just the word.", words[i]


def counting(rng: random.Random) -> tuple[str, str, str]:
    """An inventory of items and colours; asked: how many items have one colour."""
    n = rng.randint(6, 12)
    colours = rng.sample(_COLOURS, 3)
    inv = [(rng.choice(_ITEMS), rng.choice(colours)) for _ in range(n)]
    colour = rng.choice(colours)
    lines = [f"{i + 1}. a {c} {item}" for i, (item, c) in enumerate(inv)]
    answer = sum(c == colour for _, c in inv)
    return "Inventory:\n" + "\n".join(lines), f"How many {colour} things are in the inventory? Answer with a number.", str(answer)


def copying(rng: random.Random) -> tuple[str, str, str]:
    """Numbered lines of random words; asked: copy one line exactly."""
    n = rng.randint(5, 9)
    vocab = _ITEMS + _COLOURS + _PLACES + _OBJECTS
    lines = [" ".join(rng.choice(vocab) for _ in range(rng.randint(3, 6))) for _ in range(n)]
    i = rng.randrange(n)
    return ("\n".join(f"line {j + 1}: {t}" for j, t in enumerate(lines)),
            f"Repeat line {i + 1} word for word, without its label.", lines[i])


def extraction(rng: random.Random) -> tuple[str, str, str]:
    """A memo mentioning people, emails and a date; asked: one person's email, or the date."""
    people = rng.sample(_FIRST, 3)
    emails = {p: f"{p.lower()}.{rng.choice(_LAST).lower()}@{rng.choice(_DOMAINS)}" for p in people}
    day, month = rng.randint(1, 28), rng.choice(_MONTHS)
    place = rng.choice(_PLACES)
    text = (f"Memo. The review moves to {month} {day}, in the {place}. "
            f"{people[0]} ({emails[people[0]]}) chairs it; {people[1]} can be reached at {emails[people[1]]}, "
            f"and questions about catering go to {people[2]} via {emails[people[2]]}.")
    if rng.random() < 0.3:
        return text, "On what date is the review? Answer like 'March 3'.", f"{month} {day}"
    p = rng.choice(people)
    return text, f"What is the email address of {p}? Only the address.", emails[p]


def arithmetic(rng: random.Random) -> tuple[str, str, str]:
    """Assignments with additions and subtractions, interleaved with distractors; asked: a value."""
    names = rng.sample(_VARS, 6)
    value = rng.randint(2, 30)
    lines, vals = [f"{names[0]} = {value}"], {names[0]: value}
    for j in range(1, 4):
        d = rng.randint(1, 9)
        op = rng.choice("+-")
        value = value + d if op == "+" else value - d
        lines.append(f"{names[j]} = {names[j - 1]} {op} {d}")
        vals[names[j]] = value
    for extra in names[4:]:
        lines.insert(rng.randrange(len(lines) + 1), f"{extra} = {rng.randint(2, 30)}")
    return ("Program:\n" + "\n".join(lines),
            f"After the program runs, what is {names[3]}? Reply with the integer.", str(vals[names[3]]))


def tracking(rng: random.Random) -> tuple[str, str, str]:
    """A short story of an object handed from person to person; asked: who has it at the end."""
    people = rng.sample(_FIRST, 4)
    obj = rng.choice(_OBJECTS)
    holder = people[0]
    story = [f"{holder} found a {obj} in the {rng.choice(_PLACES)}."]
    for _ in range(rng.randint(2, 4)):
        other = rng.choice([p for p in people if p != holder])
        story.append(rng.choice((f"{holder} gave the {obj} to {other}.",
                                 f"Later, {other} took the {obj} from {holder}.")))
        holder = other
        if rng.random() < 0.5:
            a, b = rng.sample(people, 2)
            story.append(f"{a} talked with {b} about the weather.")
    return " ".join(story), f"Who has the {obj} at the end? Give the first name only.", holder


def ranking(rng: random.Random) -> tuple[str, str, str]:
    """A markdown table of people; asked: the oldest or youngest one's name."""
    rows = _people(rng, rng.randint(4, 7))
    ages = rng.sample(range(21, 80), len(rows))
    for r, a in zip(rows, ages, strict=True):
        r["age"] = str(a)
    table = ["| person | age | city |", "|---|---|---|", *(f"| {r['name']} | {r['age']} | {r['city']} |" for r in rows)]
    oldest = rng.random() < 0.5
    pick = (max if oldest else min)(rows, key=lambda r: int(r["age"]))
    return "\n".join(table), f"Who is the {'oldest' if oldest else 'youngest'} person in the table? Full name only.", pick["name"]


def log_search(rng: random.Random) -> tuple[str, str, str]:
    """A service log; asked: the status code of one request id."""
    n = rng.randint(6, 10)
    ids = rng.sample(range(1000, 9999), n)
    codes = [rng.choice((200, 201, 204, 301, 404, 409, 500, 503)) for _ in ids]
    lines = [f"{10 + i // 6}:{(i * 7) % 60:02d} req={rid} path=/{rng.choice(_ITEMS)} status={c}"
             for i, (rid, c) in enumerate(zip(ids, codes, strict=True))]
    i = rng.randrange(n)
    return "Access log:\n" + "\n".join(lines), f"What status did request {ids[i]} get? The number only.", str(codes[i])


def _team(task: str, difficulty: Difficulty) -> Draw:
    def draw(rng: random.Random) -> tuple[str, str, str]:
        row = team_tasks.scenario(rng, difficulty).example(task)
        return row["context"], row["instruction"], row["response"]

    draw.__doc__ = f"The shipped team's {task} task ({difficulty.key if task == 'retrieval' else task})."
    return draw


FAMILIES: dict[str, Draw] = {
    "table-name": _team("retrieval", Difficulty(records=8, tools=3)),
    "table-team": _team("retrieval", Difficulty(records=8, tools=3, key="role+team")),
    "chains": _team("planning", Difficulty(records=8, tools=3)),
    "tool": _team("tool", Difficulty(records=8, tools=3)),
    "kv-blocks": kv_blocks,
    "json-lines": json_lines,
    "prose-records": prose_records,
    "lookup": lookup,
    "counting": counting,
    "copying": copying,
    "extraction": extraction,
    "arithmetic": arithmetic,
    "tracking": tracking,
    "ranking": ranking,
    "log-search": log_search,
}
"""Every scored family by name; the first four are the shipped team's tasks (what today's joint
base saw)."""
TEAM = ("table-name", "table-team", "chains", "tool")
SCORED = tuple(FAMILIES)
LM = "lm"


def score(family: str, predicted: str, reference: str) -> bool:
    """Exact match after trimming; ``tool`` compares parsed JSON."""
    return team_tasks.score("tool" if family == "tool" else "retrieval", predicted, reference)


def generate(family: str, n: int, *, seed: int = 0) -> list[dict[str, str]]:
    """``n`` rows of ``family`` (``lm`` included), reproducible from ``seed``."""
    if family == LM:
        return lm_rows(n, seed=seed)
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join((*FAMILIES, LM))}")
    rng = random.Random(f"family/{family}/{seed}")
    rows = []
    for _ in range(n):
        context, instruction, response = FAMILIES[family](rng)
        rows.append({"task": family, "context": context, "instruction": instruction, "response": response})
    return rows


def lm_rows(n: int, *, seed: int = 0, words: int = 120, continuation: int = 24) -> list[dict[str, str]]:
    """Language modelling on the standard library's sources: a window of text as the context,
    the words that follow it as the response."""
    import os

    lib = Path(os.__file__).parent
    files = sorted(lib.glob("*.py"))
    rng = random.Random(f"family/lm/{seed}")
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        text = rng.choice(files).read_text(encoding="utf-8", errors="replace").split()
        if len(text) < words + continuation + 1:
            continue
        start = rng.randrange(len(text) - words - continuation)
        rows.append({"task": LM, "context": " ".join(text[start:start + words]),
                     "instruction": "Continue the text.",
                     "response": " ".join(text[start + words:start + words + continuation])})
    return rows


def mixture(families: Sequence[str], per_family: int, *, seed: int = 0) -> list[dict[str, str]]:
    """``per_family`` rows of each family, shuffled together (the joint stage batches by task)."""
    rows = [r for f in families for r in generate(f, per_family, seed=seed)]
    random.Random(f"mixture/{seed}").shuffle(rows)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m server.training.families FAMILY|all --train N --held-out M --out DIR``."""
    p = argparse.ArgumentParser(description="Write train/held-out JSONL rows of task families "
                                "(held-out rows come from a seed of their own).")
    p.add_argument("family", help=f"one of {', '.join((*FAMILIES, LM))}, or 'all'")
    p.add_argument("--train", type=int, default=800)
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=".")
    a = p.parse_args(argv)
    names = [*FAMILIES, LM] if a.family == "all" else [a.family]
    for name in names:
        if name not in FAMILIES and name != LM:
            p.error(f"unknown family {name!r}; choose from {', '.join((*FAMILIES, LM))}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        for part, n, seed in (("train", a.train, 2 * a.seed), ("heldout", a.held_out, 2 * a.seed + 1)):
            path = out / f"{name}-{part}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in generate(name, n, seed=seed)))
            print(f"wrote {n} rows to {path}")


def _describe() -> dict[str, Any]:  # for the docs' table: family -> first line of its docstring
    return {name: (draw.__doc__ or "").strip().splitlines()[0] for name, draw in FAMILIES.items()}


if __name__ == "__main__":
    main()
