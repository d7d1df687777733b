"""Incremental detokenization with stop strings, for streaming.

Text goes out only once it is final: never half a UTF-8 character (a byte-level token may end
mid-character, which decodes to U+FFFD), and never text that could still turn out to be the
start of a stop string. When a stop string appears, the text before it is the answer (OpenAI's
rule: the stop string itself is not returned).

>>> class Chars:                                  # a toy tokenizer: token id = character code
...     def decode(self, ids, **kw): return "".join(map(chr, ids))
>>> d = TextStream(Chars(), stop=("END",))
>>> [d.push(ord(c)) for c in "okEN"], d.push(ord("D")), d.text
(['o', 'k', '', ''], '', 'ok')
>>> d.stopped
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], **kwargs: object) -> str: ...


class TextStream:
    """The text of a request's generated tokens, released as it becomes final."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already released
        self.text = ""  # the final text so far (stop strings cut)
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; returns the newly final text (possibly empty)."""
        if self.stopped:
            raise RuntimeError("push after a stop string")
        self.token_ids.append(token_id)
        full = self._tok.decode(self.token_ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        for s in self._stop:
            at = full.find(s, max(0, self._emitted - len(s) + 1))
            if at != -1:
                self.stopped = True
                return self._release(full, at)
        return self._release(full, len(full) - self._safe_hold(full))

    def finish(self) -> str:
        """No more tokens (length limit or stop token): release what was held back."""
        if self.stopped:
            return ""
        full = self._tok.decode(self.token_ids, skip_special_tokens=True)
        return self._release(full, len(full))

    def _safe_hold(self, full: str) -> int:
        """Length of the longest tail of ``full`` that is a proper prefix of some stop string."""
        for n in range(min(self._hold, len(full) - self._emitted), 0, -1):
            tail = full[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _release(self, full: str, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = full[self._emitted : upto]
        self._emitted = upto
        self.text += delta
        return delta
