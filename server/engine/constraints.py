"""Constrained decoding: what a request's output must match, and the per-request matchers that
turn it into a mask over the vocabulary at every step.

A :class:`Constraint` is part of a request's :class:`~server.engine.sampling.SamplingParams`:

- ``json_schema``: ``value`` is a JSON Schema (as JSON text); the output is one JSON value valid
  against it;
- ``json_object``: any JSON object (``value`` is empty);
- ``regex``: ``value`` is a regular expression the whole output matches;
- ``choice``: ``value`` is a JSON list of strings; the output is exactly one of them;
- ``lark``: ``value`` is a grammar in llguidance's Lark dialect (which embeds JSON schemas with
  ``%json {...}``); the tool-calling formats are written in it.

>>> Constraint("choice", '["yes", "no"]').kind
'choice'
>>> Constraint("xml", "")
Traceback (most recent call last):
...
server.engine.errors.InvalidRequest: constraint kind 'xml' is not one of: json_schema, json_object, regex, choice, lark
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from server.engine.errors import InvalidRequest

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What one request's output must match (see the module docstring for the kinds)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"constraint kind {self.kind!r} is not one of: {', '.join(KINDS)}")
        if self.kind == "json_object":
            return
        if not self.value:
            raise InvalidRequest(f"a {self.kind} constraint needs its value (the {_WHAT[self.kind]})")
        if self.kind in ("json_schema", "choice"):
            try:
                parsed = json.loads(self.value)
            except json.JSONDecodeError as err:
                raise InvalidRequest(f"{self.kind} constraint: the {_WHAT[self.kind]} is not valid JSON: {err}") from None
            if self.kind == "json_schema" and not isinstance(parsed, dict | bool):
                raise InvalidRequest("json_schema constraint: a JSON Schema is an object (or true/false)")
            if self.kind == "choice" and (not isinstance(parsed, list) or not parsed
                                          or not all(isinstance(c, str) and c for c in parsed)):
                raise InvalidRequest("choice constraint: send a non-empty JSON list of non-empty strings")


_WHAT = {"json_schema": "schema", "regex": "pattern", "choice": "list of choices", "lark": "grammar"}
