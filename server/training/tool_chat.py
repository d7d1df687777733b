"""Chat conversations with OpenAI tools, laid out exactly as the server lays out a chat request
with ``tools`` (the documented tool prompt, ``docs/tools.md``), for training an agent that calls
tools of its own accord (``tool_choice="auto"``) and answers from their results.

Each row is one step of a ReAct loop, with its response:

- ``call``: a question one of the listed tools answers -> ``<tool_call>[{...}]</tool_call>``
  (two calls when the question asks about two things);
- ``answer``: the same conversation after the tool results -> a plain-text answer that uses them;
- ``direct``: a greeting, thanks or "repeat" request, with tools listed -> plain text, no call.

The tools come from :data:`TOOL_KINDS`; :data:`UNSEEN_KINDS` are kept out of ``generate(...,
unseen=False)`` (the default), so a held-out set of them measures calls to tools never trained
on. Rows are the JSONL format of :mod:`server.training.dataset`, with the final message's
``role`` (``user`` or ``tool``).

>>> rows = generate(6, seed=0)
>>> sorted(rows[0]), [r["kind"] for r in rows]
(['context', 'instruction', 'kind', 'response', 'role', 'task'], ['call', 'answer', 'call', 'answer', 'direct', 'call'])
>>> rows[0]["response"].startswith("<tool_call>[{")
True
>>> score(rows[1]["response"], rows[1])     # an answer must use the results
True
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from agentshare.protocol import ChatMessage, Tool
from server.api.tools import CLOSE, OPEN, parse_tool_calls, render_messages

TASK = "tool_chat"
KINDS = ("call", "answer", "direct")
MIX = (0.45, 0.4, 0.15)
"""Share of each kind of row."""

_CITY = ("Lisbon", "Oslo", "Lagos", "Quito", "Hanoi", "Perth", "Riga", "Tunis", "Lima", "Cork", "Bern",
         "Accra", "Dakar", "Split", "Turku", "Nara", "Porto", "Graz", "Minsk", "Sofia", "Denver", "Kyoto")
_COUNTRY = ("Norway", "Peru", "Ghana", "Vietnam", "Chile", "Kenya", "Portugal", "Austria", "Nepal", "Canada",
            "Morocco", "Finland", "Japan", "Brazil", "Egypt", "Poland", "Mexico", "Iceland")
_PERSON = ("Ada Berg", "Chen Ito", "Dara Fox", "Elif Kim", "Hugo Moss", "Ines Park", "Omar Reed", "Priya Sato",
           "Rosa Tran", "Sven Wolf", "Uma Young", "Wei Lund")
_WORD = ("harbor", "lantern", "meadow", "quartz", "saddle", "thimble", "velvet", "walnut", "zephyr", "orbit")
_LANG = ("French", "German", "Spanish", "Italian", "Dutch", "Swedish", "Polish", "Turkish")
_TICKER = ("ACME", "GLOBX", "INITE", "UMBRL", "STARK", "WAYNE", "HOOLI", "VANDL")
_FILE = ("notes.txt", "config.yaml", "todo.md", "README.md", "setup.cfg", "data.csv")
_TEST = ("tests/test_api.py", "tests/test_db.py", "tests/test_cli.py", "tests/test_auth.py")
_DAY = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")


_PART = ("ledger", "cache", "queue", "auth", "billing", "search", "event", "stream", "report", "export",
         "image", "token", "order", "notify", "sync", "batch", "index", "gateway", "payment", "audit",
         "session", "profile", "metric", "schedule", "archive", "render", "mail", "route", "backup", "shard")
_ROLE = ("writer", "reader", "worker", "service", "proxy", "api", "store", "daemon", "runner", "bot")


def _pick(pool: tuple[str, ...]) -> Any:
    return lambda rng: rng.choice(pool)


def _ident(rng: random.Random) -> str:
    """A made-up identifier (``billing-proxy``, ``audit_runner2``, ``Searchstore``): arguments the
    model can only copy from the question, never recall from a list."""
    a, b = rng.choice(_PART), rng.choice(_PART + _ROLE)
    form = rng.randrange(4)
    if form == 0:
        return f"{a}-{b}"
    if form == 1:
        return f"{a}_{b}{rng.randint(1, 9)}"
    if form == 2:
        return f"{a.capitalize()}{b}"
    return f"{a}-{b}-{rng.choice(_ROLE)}"


_VALUES = {"city": _pick(_CITY), "country": _pick(_COUNTRY), "person": _pick(_PERSON), "word": _pick(_WORD),
           "language": _pick(_LANG), "ticker": _pick(_TICKER), "file": _pick(_FILE), "test": _pick(_TEST),
           "day": _pick(_DAY), "int": lambda rng: rng.randint(2, 500), "order": lambda rng: rng.randint(1000, 9999),
           "ident": _ident}
_RESULTS = {
    "weather": lambda rng: f"{rng.randint(-5, 34)} C, {rng.choice(('sunny', 'cloudy', 'rain', 'snow', 'windy'))}",
    "number": lambda rng: str(rng.randint(2, 99999)),
    "money": lambda rng: f"{rng.randint(1, 900)}.{rng.randint(0, 99):02d}",
    "word": lambda rng: rng.choice(("maison", "Haus", "casa", "huis", "hus", "dom", "ev", "lampe", "porto")),
    "time": lambda rng: f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}",
    "currency": lambda rng: rng.choice(("krone", "sol", "cedi", "dong", "peso", "shilling", "euro", "zloty")),
    "language": lambda rng: rng.choice(("Norwegian", "Spanish", "English", "Vietnamese", "Swahili", "Polish")),
    "status": lambda rng: rng.choice(("shipped", "delivered", "pending", "cancelled", "in transit")),
    "email": lambda rng: f"{rng.choice(('ada', 'chen', 'dara', 'elif', 'hugo', 'ines'))}@example.com",
    "text": lambda rng: rng.choice(("Buy milk and eggs.", "port: 8080", "Release on Friday.", "name,age\nAda,31")),
    "tests": lambda rng: f"{rng.randint(1, 40)} passed, {rng.randint(0, 3)} failed",
    "booking": lambda rng: f"confirmed at {rng.randint(9, 17)}:00",
    "code": lambda rng: f"+{rng.randint(1, 99)}",
    "continent": lambda rng: rng.choice(("Europe", "Africa", "Asia", "South America", "North America")),
    "version": lambda rng: f"{rng.randint(0, 12)}.{rng.randint(0, 30)}.{rng.randint(0, 9)}",
    "restart": lambda rng: rng.choice(("restarted, 3 of 3 pods ready", "restarted, healthy", "restart failed: timeout")),
    "user": lambda rng: f"{rng.choice(_PERSON)}, {rng.choice(('admin', 'editor', 'viewer'))}",
    "owner": lambda rng: rng.choice(("team payments", "team storage", "team search", "team platform")),
}


@dataclass(frozen=True, slots=True)
class ToolKind:
    """A kind of tool: name choices, description, parameters ``(name, JSON type, value kind)``,
    question and answer templates (``{param}``, ``{result}``), and the kind of its results."""

    names: tuple[str, ...]
    description: str
    params: tuple[tuple[str, str, str], ...]
    questions: tuple[str, ...]
    answer: str
    result: str


TOOL_KINDS: tuple[ToolKind, ...] = (
    ToolKind(("get_weather", "weather", "current_weather"), "Current weather in a city.",
             (("city", "string", "city"),), ("What is the weather in {city}?", "How is the weather in {city} today?"),
             "The weather in {city} is {result}.", "weather"),
    ToolKind(("population_of", "get_population"), "The number of people living in a city.",
             (("city", "string", "city"),), ("How many people live in {city}?", "What is the population of {city}?"),
             "{city} has {result} inhabitants.", "number"),
    ToolKind(("currency_of", "get_currency"), "The currency used in a country.",
             (("country", "string", "country"),), ("Which currency is used in {country}?",
                                                   "What money do people pay with in {country}?"),
             "The currency of {country} is the {result}.", "currency"),
    ToolKind(("language_of", "official_language"), "The main language spoken in a country.",
             (("country", "string", "country"),), ("What language is spoken in {country}?",
                                                   "Which language do people speak in {country}?"),
             "People in {country} speak {result}.", "language"),
    ToolKind(("stock_price", "get_quote"), "Latest share price for a ticker symbol, in dollars.",
             (("ticker", "string", "ticker"),), ("What is the stock price of {ticker}?",
                                                 "How much does one {ticker} share cost?"),
             "One {ticker} share costs ${result}.", "money"),
    ToolKind(("convert_currency", "fx_convert"), "Convert an amount of euros into another currency.",
             (("amount", "integer", "int"), ("currency", "string", "ticker")),
             ("How much is {amount} euros in {currency}?", "Convert {amount} EUR to {currency}."),
             "{amount} euros is {result} {currency}.", "money"),
    ToolKind(("translate", "translate_word"), "Translate an English word into a language.",
             (("word", "string", "word"), ("language", "string", "language")),
             ("How do you say {word} in {language}?", "Translate the word {word} into {language}."),
             "In {language}, {word} is \"{result}\".", "word"),
    ToolKind(("local_time", "get_time"), "The current local time in a city.",
             (("city", "string", "city"),), ("What time is it in {city}?", "What is the local time in {city}?"),
             "It is {result} in {city}.", "time"),
    ToolKind(("order_status", "track_order"), "The delivery status of an order.",
             (("order_id", "integer", "order"),), ("Where is my order {order_id}?",
                                                   "What is the status of order {order_id}?"),
             "Order {order_id} is {result}.", "status"),
    ToolKind(("email_of", "find_email"), "The email address of a colleague.",
             (("name", "string", "person"),), ("What is the email address of {name}?", "How can I email {name}?"),
             "You can email {name} at {result}.", "email"),
    ToolKind(("read_file", "open_file"), "Read a text file and return its contents.",
             (("path", "string", "file"),), ("What does {path} say?", "Show me the contents of {path}."),
             "{path} contains: {result}", "text"),
    ToolKind(("run_tests", "pytest"), "Run a test file and report the results.",
             (("path", "string", "test"),), ("Run the tests in {path}.", "Do the tests in {path} pass?"),
             "The tests in {path}: {result}.", "tests"),
    ToolKind(("book_meeting", "schedule_meeting"), "Book a meeting with a person on a weekday.",
             (("person", "string", "person"), ("day", "string", "day")),
             ("Book a meeting with {person} on {day}.", "Schedule time with {person} on {day}, please."),
             "Your meeting with {person} on {day} is {result}.", "booking"),
    ToolKind(("package_version", "installed_version"), "The installed version of a software package.",
             (("package", "string", "ident"),), ("Which version of {package} is installed?",
                                                 "What version of the {package} package do we have?"),
             "{package} is at version {result}.", "version"),
    ToolKind(("restart_service", "restart"), "Restart a service and report its state.",
             (("service", "string", "ident"),), ("Restart {service}.", "Please restart the {service} service."),
             "{service}: {result}.", "restart"),
    ToolKind(("lookup_user", "find_user"), "Look up an account by its username.",
             (("username", "string", "ident"),), ("Who is the user {username}?", "Look up the account {username}."),
             "{username} is {result}.", "user"),
    ToolKind(("owner_of", "service_owner"), "The team that owns a service.",
             (("service", "string", "ident"),), ("Who owns {service}?", "Which team owns the {service} service?"),
             "{service} is owned by {result}.", "owner"),
    ToolKind(("square", "square_number"), "The square of an integer.",
             (("n", "integer", "int"),), ("What is {n} squared?", "Compute the square of {n}."),
             "{n} squared is {result}.", "number"),
    # kept out of training (UNSEEN_KINDS): calls to tools the module never saw
    ToolKind(("dialing_code", "phone_prefix"), "The international dialing code of a country.",
             (("country", "string", "country"),), ("What is the dialing code of {country}?",
                                                   "Which phone prefix does {country} use?"),
             "The dialing code of {country} is {result}.", "code"),
    ToolKind(("continent_of", "get_continent"), "The continent a country is on.",
             (("country", "string", "country"),), ("On which continent is {country}?",
                                                   "Which continent is {country} part of?"),
             "{country} is in {result}.", "continent"),
    ToolKind(("city_area", "area_of_city"), "The area of a city in square kilometres.",
             (("city", "string", "city"),), ("How large is {city} in square kilometres?", "What is the area of {city}?"),
             "{city} covers {result} square kilometres.", "number"),
)
UNSEEN_KINDS = 3
"""The last kinds of :data:`TOOL_KINDS`, never in training rows."""

_HINT = (" Use the {name} tool.", " Use a tool.", "", "", "")
_SYSTEM = ("You are a helpful assistant.", "You are an assistant with tools. Be brief.")
_DIRECT = (
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hello! How can I help you today?"),
    ("Thank you!", "You're welcome!"),
    ("Thanks, that is all.", "You're welcome!"),
    ("Who are you?", "I am an assistant. I can answer questions and use tools when they help."),
)


def generate(n: int, *, seed: int = 0, unseen: bool = False) -> list[dict[str, Any]]:
    """``n`` rows (kinds mixed by :data:`MIX`), reproducible from ``seed``; ``unseen`` draws the
    asked tool from :data:`UNSEEN_KINDS` only (a held-out set of new tools)."""
    rng = random.Random(f"{TASK}/{seed}/{unseen}")
    asked = TOOL_KINDS[-UNSEEN_KINDS:] if unseen else TOOL_KINDS[:-UNSEEN_KINDS]
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        r = rng.random()
        if r < MIX[2] and not unseen:
            rows.append(_direct(rng))
            continue
        call, answer = _episode(rng, rng.choice(asked), unseen=unseen)
        rows.append(call)
        if len(rows) < n:
            rows.append(answer)
    return rows


def score(predicted: str, row: dict[str, Any]) -> bool:
    """A ``call`` row: the same calls (parsed JSON, in order). Otherwise: plain text (no call),
    and for an ``answer`` row it contains every tool result (``row["results"]``)."""
    want = parse_tool_calls(row["response"], "x")
    got = parse_tool_calls(predicted, "x")
    if want is not None:
        return got is not None and [_plain(c) for c in got] == [_plain(c) for c in want]
    if got is not None or OPEN in predicted:
        return False
    return all(res in predicted for res in row.get("results", ())) and bool(predicted.strip())


def _plain(call: dict[str, Any]) -> tuple[str, Any]:
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def _schema(rng: random.Random, kind: ToolKind) -> tuple[Tool, str]:
    name = rng.choice(kind.names)
    props = {p: {"type": t} for p, t, _ in kind.params}
    params: dict[str, Any] = {"properties": props, "required": [p for p, _, _ in kind.params], "type": "object"}
    if rng.random() < 0.5:  # OpenAI's examples put "type" first, LangChain's last
        params = {"type": "object", "properties": props, "required": params["required"]}
    fn: dict[str, Any] = {"name": name, "parameters": params}
    if rng.random() < 0.9:
        fn["description"] = kind.description
    return Tool.model_validate({"type": "function", "function": fn}), name


def _toolset(rng: random.Random, kind: ToolKind, *, unseen: bool = False) -> tuple[list[Tool], str]:
    pool = TOOL_KINDS if unseen else TOOL_KINDS[:-UNSEEN_KINDS]  # training rows never list an unseen tool
    others = [k for k in pool if k is not kind]
    picked = [kind, *rng.sample(others, rng.randint(0, 3))]
    rng.shuffle(picked)
    tools, name = [], ""
    for k in picked:
        tool, n = _schema(rng, k)
        tools.append(tool)
        if k is kind:
            name = n
    return tools, name


def _history(rng: random.Random) -> list[ChatMessage]:
    out = []
    if rng.random() < 0.3:
        out.append(ChatMessage(role="system", content=rng.choice(_SYSTEM)))
    if rng.random() < 0.15:
        q, a = rng.choice(_DIRECT)
        out += [ChatMessage(role="user", content=q), ChatMessage(role="assistant", content=a)]
    return out


def _episode(rng: random.Random, kind: ToolKind, *, unseen: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    tools, name = _toolset(rng, kind, unseen=unseen)
    two = len(kind.params) == 1 and rng.random() < 0.2  # ask about two things: two calls
    args = [{p: _VALUES[v](rng) for p, _, v in kind.params} for _ in range(2 if two else 1)]
    if two and args[0] == args[1]:
        args = args[:1]
    question = rng.choice(kind.questions)
    if len(args) == 2:
        p = kind.params[0][0]
        question = question.replace("{" + p + "}", f"{{{p}}} and {args[1][p]}", 1)
    text = question.format(**args[0]) + rng.choice(_HINT).format(name=name)
    history = [*_history(rng), ChatMessage(role="user", content=text)]
    calls = [{"name": name, "arguments": a} for a in args]
    call_text = OPEN + json.dumps(calls, separators=(",", ":")) + CLOSE  # compact, as the grammar holds it
    results = [_RESULTS[kind.result](rng) for _ in args]
    ids = [f"call_{rng.getrandbits(64):016x}" for _ in args]
    assistant = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(a)}}
        for i, a in zip(ids, args, strict=True)]})
    answered = [ChatMessage(role="tool", content=res, tool_call_id=i) for i, res in zip(ids, results, strict=True)]
    answer = " ".join(kind.answer.format(result=res, **a) for a, res in zip(args, results, strict=True))
    return (_row(history, tools, call_text, "call"),
            {**_row([*history, assistant, *answered], tools, answer, "answer"), "results": results})


def _direct(rng: random.Random) -> dict[str, Any]:
    tools, _ = _toolset(rng, rng.choice(TOOL_KINDS[:-UNSEEN_KINDS]))
    if rng.random() < 0.4:
        word = rng.choice(_WORD)
        q, a = f"Repeat the word {word}.", word
    else:
        q, a = rng.choice(_DIRECT)
    return _row([*_history(rng), ChatMessage(role="user", content=q)], tools, a, "direct")


def _row(messages: list[ChatMessage], tools: list[Tool], response: str, kind: str) -> dict[str, Any]:
    rendered = render_messages(messages, tools, native=False)
    last = rendered[-1]
    return {"context": rendered[:-1], "instruction": last["content"], "role": last["role"],
            "response": response, "task": TASK, "kind": kind}
