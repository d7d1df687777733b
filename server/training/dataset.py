"""Fine-tuning data: JSONL rows read and checked, laid out in the canonical order, and batched.

One JSON object per line::

    {"context": "<shared document>" | [{"role": ..., "content": ...}, ...],
     "instruction": "<the agent's question>", "response": "<what it should answer>",
     "family": "<64 hex, optional: the prefill family the row was made for>",
     "role": "user" | "tool" (optional, default "user": the role of the instruction's message)}

Each row is laid out with :func:`server.prompt.chat_prompt` — exactly as the server lays out a
request — so the invocation point (IP) at training equals the IP at serving. Errors name the
file, the line and the field (:class:`DataError`).

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
>>> _ = p.write_text('{"context": "doc", "instruction": "q", "response": "a"}\\n'
...                  '{"context": "doc", "instruction": "q", "response": ""}\\n')
>>> try:
...     read_jsonl(p)
... except DataError as exc:
...     print(str(exc).split("/")[-1])
d.jsonl:2: field 'response' is empty
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from server import positions
from server.prompt import Placement, chat_prompt

REQUIRED = ("context", "instruction", "response")
ROLES = ("user", "tool")
"""Roles the instruction's message may have: a question, or the tool results a ReAct step reads."""


class DataError(ValueError):
    """A data set that cannot be used; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class Example:
    """One (shared context, instruction, response) row; ``line`` is its 1-based line number."""

    context: tuple[dict[str, str], ...]
    instruction: str
    response: str
    line: int = 0
    source: str = "data"
    family: str | None = None
    task: str | None = None
    role: str = "user"

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


@dataclass(frozen=True, slots=True)
class Encoded:
    """Token ids of prompt + response, the IP, and where the response starts (loss from there)."""

    ids: tuple[int, ...]
    ip: int
    response_start: int
    where: str = ""


def parse_row(obj: Any, *, line: int = 0, source: str = "data") -> Example:
    """Check one decoded JSON row and turn it into an :class:`Example`.

    >>> parse_row({"context": "doc", "instruction": "q", "response": "a"}).context
    ({'role': 'user', 'content': 'doc'},)
    >>> try:
    ...     parse_row({"context": "doc", "response": "a"}, line=7)
    ... except DataError as exc:
    ...     print(exc)
    data:7: missing field 'instruction'
    """
    where = f"{source}:{line}"
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in REQUIRED:
        if name not in obj:
            raise DataError(f"{where}: missing field {name!r}")
    for name in ("instruction", "response"):
        if not isinstance(obj[name], str):
            raise DataError(f"{where}: field {name!r} must be a string")
        if not obj[name].strip():
            raise DataError(f"{where}: field {name!r} is empty")
    ctx = obj["context"]
    if isinstance(ctx, str):
        messages: tuple[dict[str, str], ...] = ({"role": "user", "content": ctx},) if ctx else ()
    elif isinstance(ctx, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in ctx
    ):
        messages = tuple({"role": m["role"], "content": m["content"]} for m in ctx)
    else:
        raise DataError(f"{where}: field 'context' must be a string or a list of "
                        "{'role': str, 'content': str} messages")
    family = obj.get("family")
    if family is not None and not isinstance(family, str):
        raise DataError(f"{where}: field 'family' must be a string")
    task = obj.get("task")
    role = obj.get("role", "user")
    if role not in ROLES:
        raise DataError(f"{where}: field 'role' must be one of {', '.join(map(repr, ROLES))}, got {role!r}")
    return Example(messages, obj["instruction"], obj["response"], line, source, family,
                   task if isinstance(task, str) else None, role)


def read_jsonl(path: Path | str) -> list[Example]:
    """Read and check every row of a JSONL file; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except ValueError as exc:
                raise DataError(f"{path}:{i}: not valid JSON ({exc})") from None
            rows.append(parse_row(obj, line=i, source=str(path)))
    if not rows:
        raise DataError(f"{path}: the data set is empty")
    return rows


def write_jsonl(rows: Sequence[dict[str, Any]], path: Path | str) -> Path:
    """Write rows one JSON object a line (the format :func:`read_jsonl` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def check_family(examples: Sequence[Example], family: str) -> None:
    """Refuse rows that name another prefill family than the base's."""
    for ex in examples:
        if ex.family is not None and ex.family != family:
            raise DataError(f"{ex.where}: field 'family' names {ex.family[:12]}…, but the base "
                            f"model's family is {family[:12]}…; the row was made for another base")


def prompt_of(tokenizer: Any, ex: Example) -> Any:
    """The canonical :class:`server.prompt.Prompt` of an example (no response)."""
    return chat_prompt(tokenizer, list(ex.context), [{"role": ex.role, "content": ex.instruction}])


def encode(examples: Sequence[Example], tokenizer: Any, *, placement: Placement = Placement.TURN,
           max_length: int = 2048, with_response: bool = True) -> list[Encoded]:
    """Lay out each example canonically; the response ends with the tokenizer's EOS token."""
    eos = tokenizer.eos_token_id
    module = positions.Facts("trained", shares_prefill=True, placement=placement)  # it joins the family
    out = []
    for ex in examples:
        prompt = prompt_of(tokenizer, ex)
        ids = list(prompt.token_ids)
        start = len(ids)
        if with_response:
            ids += list(tokenizer.encode(ex.response, add_special_tokens=False)) + [eos]
        if len(ids) > max_length:
            raise DataError(f"{ex.where}: the example is {len(ids)} tokens long, over the limit "
                            f"of {max_length} (max_length); shorten its context or raise the limit")
        out.append(Encoded(tuple(ids), positions.invocation_point(prompt, module), start, ex.where))
    return out


@dataclass(frozen=True, slots=True)
class Batch:
    """Examples split at their IPs: ``[pad | prefix][pad | suffix]``, every row ending together.

    The prefix (< IP) is left-padded to ``prefix_len`` columns and the suffix (>= IP) to the rest,
    so one cache split serves every row. ``labels`` cover the suffix columns (-100 = no loss).
    """

    input_ids: torch.Tensor  # (B, P + S)
    attention_mask: torch.Tensor  # (B, P + S), 0 on padding
    position_ids: torch.Tensor  # (B, P + S), real positions (padding skipped)
    labels: torch.Tensor  # (B, S): the token each suffix column predicts, or -100
    prefix_len: int  # P

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on ``device``."""
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.position_ids.to(device),
                     self.labels.to(device), self.prefix_len)


def collate(items: Sequence[Encoded], pad_id: int, *, split: bool = True) -> Batch:
    """Batch encoded examples; ``split=False`` puts everything in the suffix (own prefill).

    >>> b = collate([Encoded((1, 2, 3, 4), 2, 3), Encoded((5, 6, 7), 1, 2)], pad_id=0)
    >>> b.input_ids.tolist(), b.prefix_len
    ([[1, 2, 3, 4], [0, 5, 6, 7]], 2)
    >>> b.position_ids.tolist(), b.labels.tolist()
    ([[0, 1, 2, 3], [0, 0, 1, 2]], [[4, -100], [7, -100]])
    """
    ips = [it.ip if split else 0 for it in items]
    P = max(ips)
    S = max(len(it.ids) - ip for it, ip in zip(items, ips, strict=True))
    B = len(items)
    ids = torch.full((B, P + S), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P + S), dtype=torch.long)
    labels = torch.full((B, S), -100, dtype=torch.long)
    for r, (it, ip) in enumerate(zip(items, ips, strict=True)):
        pre, suf = it.ids[:ip], it.ids[ip:]
        ids[r, P - len(pre):P] = torch.tensor(pre, dtype=torch.long)
        mask[r, P - len(pre):P] = 1
        off = P + S - len(suf)
        ids[r, off:] = torch.tensor(suf, dtype=torch.long)
        mask[r, off:] = 1
        # suffix column c (absolute index ip + c - (S - len(suf))) predicts the next token
        for k in range(max(it.response_start, ip + 1), len(it.ids)):
            labels[r, (k - 1 - ip) + (S - len(suf))] = it.ids[k]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch(ids, mask, pos, labels, P)
