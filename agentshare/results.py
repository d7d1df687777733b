"""What the SDK returns: plain dataclasses, readable in a terminal, in Jupyter and with rich.

::

    Answer       one agent's answer: text, finish_reason, usage, timings
    Chunk        one piece of a streamed answer (the last carries finish_reason and usage)
    ForkResult   the answers of several agents on one shared context, plus the wall time
    Usage        prompt tokens: cached (shared) vs computed; completion tokens
    Timings      time to first token, total

>>> a = Answer(agent="planner", module="base", text="1. Read the doc.", finish_reason="stop",
...            usage=Usage(prompt_tokens=830, cached_tokens=816, computed_tokens=14, completion_tokens=6),
...            timings=Timings(ttft=0.12, total=0.5))
>>> print(ForkResult((a,), wall=0.5, context_tokens=820).table())
agent    module  prompt  cached  computed  out  TTFT s  total s  answer
planner  base       830     816        14    6    0.12     0.50  1. Read the doc.
1 agent on one shared context of 820 tokens; wall time 0.50 s
>>> ForkResult((a,), wall=0.5, context_tokens=820)["planner"].usage.cached_tokens
816
"""

from __future__ import annotations

import html
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

from agentshare import protocol

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Prompt tokens served from the cache (``cached_tokens``: shared with other agents or
    earlier turns) vs prefilled by this request (``computed_tokens``)."""

    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    completion_tokens: int

    @classmethod
    def of(cls, u: protocol.GenerationUsage) -> Usage:
        return cls(u.prompt_tokens, u.cached_tokens, u.computed_tokens, u.completion_tokens)


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds, measured by the client: to the first chunk carrying a token, and to the end."""

    ttft: float | None
    total: float


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a streamed answer."""

    agent: str
    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """One agent's answer on a shared context."""

    agent: str
    module: str
    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    id: str = ""
    context_id: str = ""
    token_ids: tuple[int, ...] = ()

    def __str__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return _html_table((self,), footer="")

    def __rich__(self) -> Any:
        return _rich_table((self,), title=None)


@dataclass(frozen=True, slots=True)
class ForkResult(Sequence[Answer]):
    """The answers of a fork, in the order asked; index by position or by agent name."""

    answers: tuple[Answer, ...]
    wall: float
    context_tokens: int

    @overload
    def __getitem__(self, key: int | str) -> Answer: ...
    @overload
    def __getitem__(self, key: slice) -> Sequence[Answer]: ...

    def __getitem__(self, key: int | str | slice) -> Answer | Sequence[Answer]:
        if isinstance(key, str):
            for a in self.answers:
                if a.agent == key:
                    return a
            raise KeyError(key)
        return self.answers[key]

    def __len__(self) -> int:
        return len(self.answers)

    def __iter__(self) -> Iterator[Answer]:
        return iter(self.answers)

    @property
    def texts(self) -> dict[str, str]:
        return {a.agent: a.text for a in self.answers}

    @property
    def cached_tokens(self) -> int:
        return sum(a.usage.cached_tokens for a in self.answers)

    @property
    def computed_tokens(self) -> int:
        return sum(a.usage.computed_tokens for a in self.answers)

    def summary(self) -> str:
        n = len(self.answers)
        return (f"{n} agent{'s' if n != 1 else ''} on one shared context of {self.context_tokens} tokens; "
                f"wall time {self.wall:.2f} s")

    def table(self, *, width: int = 60) -> str:
        """A plain-text table (answers cut to ``width`` characters, on one line)."""
        head = ("agent", "module", "prompt", "cached", "computed", "out", "TTFT s", "total s", "answer")
        rows = [head] + [_row(a, width) for a in self.answers]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
        lines = []
        for r in rows:
            cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))]
            lines.append("  ".join([*cells, r[-1]]).rstrip())
        return "\n".join([*lines, self.summary()])

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        return _html_table(self.answers, footer=self.summary())

    def __rich__(self) -> Any:
        return _rich_table(self.answers, title=self.summary())


def _row(a: Answer, width: int | None) -> tuple[str, ...]:
    text = " ".join(a.text.split())
    if width is not None and len(text) > width:
        text = text[: width - 1] + "…"
    ttft = "-" if a.timings.ttft is None else f"{a.timings.ttft:.2f}"
    u = a.usage
    return (a.agent, a.module, str(u.prompt_tokens), str(u.cached_tokens), str(u.computed_tokens),
            str(u.completion_tokens), ttft, f"{a.timings.total:.2f}", text)


def _html_table(answers: Sequence[Answer], footer: str) -> str:
    head = ("agent", "module", "prompt", "cached", "computed", "out", "TTFT s", "total s", "answer")
    th = "".join(f"<th>{h}</th>" for h in head)
    body = []
    for a in answers:
        cells = _row(a, None)[:-1]
        tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        body.append(f"<tr>{tds}<td style='text-align:left;white-space:pre-wrap'>{html.escape(a.text)}</td></tr>")
    cap = f"<caption style='caption-side:bottom'>{html.escape(footer)}</caption>" if footer else ""
    return f"<table>{cap}<thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _rich_table(answers: Sequence[Answer], title: str | None) -> Any:
    from rich.table import Table  # optional: only when rich renders us

    table = Table(caption=title)
    for h in ("agent", "module", "prompt", "cached", "computed", "out", "TTFT s", "total s"):
        table.add_column(h, justify="left" if h in ("agent", "module") else "right")
    table.add_column("answer", overflow="fold")
    for a in answers:
        table.add_row(*_row(a, None)[:-1], a.text)
    return table
