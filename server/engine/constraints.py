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
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

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


# ---- the grammar backend (llguidance) ---------------------------------------------------------

COMPACT_JSON = {"whitespace_flexible": False}
"""JSON is generated compact (``", "`` and ``": "`` separators, no free whitespace): a model
that may write any whitespace can also write it forever."""


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked: :meth:`GrammarBackend.matcher` does).

    >>> "yes" in grammar_of(Constraint("choice", '["yes", "no"]'))
    True
    """
    from llguidance import LLMatcher

    if constraint.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(constraint.value, defaults=COMPACT_JSON)  # type: ignore[arg-type]
    if constraint.kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=COMPACT_JSON)  # type: ignore[arg-type]
    if constraint.kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.value)
    if constraint.kind == "choice":
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(constraint.value))
        return LLMatcher.grammar_from_lark(f"start: {literals}")
    return LLMatcher.grammar_from_lark(constraint.value)


class Matcher:
    """One request's place in its grammar: the mask of the tokens that may come next, the
    tokens consumed, and whether the grammar is complete."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self._m, self.n_vocab = matcher, n_vocab

    @property
    def words(self) -> int:
        """int32 words of one bitmask row."""
        return (self.n_vocab + 31) // 32

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, one bit per token; bit
        ``t % 32`` of word ``t // 32``). Releases the GIL while it computes."""
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def consume(self, token_id: int) -> None:
        """Advance past ``token_id``; raises ``ValueError`` (with llguidance's reason) if the
        grammar does not allow it."""
        if not self._m.consume_token(token_id):
            reason = self._m.get_error().strip().splitlines()[0]
            raise ValueError(f"token {token_id} does not continue the constraint's grammar: {reason}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete: nothing may follow (EOS at most)."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """What was consumed so far is a complete match (more may still follow)."""
        return bool(self._m.is_accepting())


class GrammarBackend:
    """llguidance over one tokenizer and logits width: turns constraints into :class:`Matcher` s.
    Built once per (tokenizer, width, EOS ids) (:meth:`for_tokenizer`); building takes about a second.
    """

    _built: ClassVar[dict[tuple[int, int, tuple[int, ...]], tuple[object, GrammarBackend]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, tokenizer: object, n_vocab: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast

        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise InvalidRequest("constrained decoding needs a Hugging Face fast tokenizer; this engine's is "
                                 f"{type(tokenizer).__name__}: send the request without a constraint")
        self.n_vocab = n_vocab
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab,
                                                      eos_token=list(eos_token_ids) or None)

    @classmethod
    def for_tokenizer(cls, tokenizer: object, n_vocab: int, eos_token_ids: tuple[int, ...] = ()) -> GrammarBackend:
        key = (id(tokenizer), n_vocab, tuple(eos_token_ids))
        with cls._lock:
            hit = cls._built.get(key)
            if hit is None or hit[0] is not tokenizer:
                hit = (tokenizer, cls(tokenizer, n_vocab, tuple(eos_token_ids)))
                cls._built[key] = hit
            return hit[1]

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher at the start of ``constraint``'s grammar; raises :class:`InvalidRequest`
        with llguidance's message when the schema, pattern or grammar is not valid."""
        from llguidance import LLMatcher

        try:
            grammar = grammar_of(constraint)
        except ValueError as err:
            raise InvalidRequest(f"{constraint.kind} constraint: {err}") from None
        m = LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequest(f"{constraint.kind} constraint is not valid: {m.get_error().strip()}")
        return Matcher(m, self.n_vocab)


def apply_masks(rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``rows`` [k, vocab] with every token its ``bitmask`` row [k, words] does not allow set to
    ``-inf`` (one op for the whole batch; ``rows`` is not changed).

    >>> bits = torch.tensor([[0b101], [0b010]], dtype=torch.int32)
    >>> apply_masks(torch.zeros(2, 3), bits).tolist()
    [[0.0, -inf, 0.0], [-inf, 0.0, -inf]]
    """
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, : rows.shape[1]]
    return rows.masked_fill(allowed == 0, float("-inf"))
