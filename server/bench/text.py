"""Real text for benchmark prompts: the Python standard library's sources, as token windows.

A window is picked by offset, so a session's text depends on its seed alone, whatever order the
sessions run in. Windows are decoded from the model's own tokens: re-encoded, a window of ``n``
tokens comes back as about ``n`` (a token or two either way at its edges);
:meth:`Corpus.exact` searches for a window that comes back as exactly ``n``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

FIRST = ("os.py", "subprocess.py")
"""Read first, so that small corpora hold the same text on every Python."""


class Corpus:
    """The standard library's ``*.py`` sources as the tokens of ``tokenizer``, about ``tokens`` of
    them (read file by file, in a fixed order, until there are enough).

    >>> from transformers import AutoTokenizer
    >>> corpus = Corpus(AutoTokenizer.from_pretrained(model_dir), tokens=20_000)
    >>> text, after = corpus.exact(1234, 300)
    >>> corpus.count(text), after > 1234, abs(corpus.count(corpus.window(99, 300)) - 300) <= 4
    (300, True, True)
    """

    def __init__(self, tokenizer: Any, *, tokens: int = 400_000) -> None:
        self.tok = tokenizer
        lib = Path(os.__file__).parent
        files = [lib / f for f in FIRST] + [p for p in sorted(lib.glob("*.py")) if p.name not in FIRST]
        self.ids: list[int] = []
        for path in files:
            if len(self.ids) >= tokens:
                break
            self.ids += tokenizer.encode(path.read_text(encoding="utf-8", errors="replace") + "\n\n",
                                         add_special_tokens=False)
        if len(self.ids) < 2:
            raise RuntimeError(f"no standard-library sources found beside {lib}")

    def __len__(self) -> int:
        return len(self.ids)

    def count(self, text: str) -> int:
        """Tokens of ``text`` (no special tokens)."""
        return len(self.tok.encode(text, add_special_tokens=False))

    def window(self, offset: int, n: int) -> str:
        """The text of the ``n`` tokens from ``offset`` (taken modulo the corpus, wrapping round)."""
        if n < 1:
            raise ValueError(f"a window holds at least one token, got {n}")
        n = min(n, len(self.ids))
        start = offset % (len(self.ids) - n + 1)
        return str(self.tok.decode(self.ids[start:start + n], clean_up_tokenization_spaces=False))

    def exact(self, offset: int, n: int) -> tuple[str, int]:
        """A window from about ``offset`` whose text re-encodes to exactly ``n`` tokens, and the
        offset after it (for consecutive windows); raises ``RuntimeError`` when none is found."""
        pos = offset
        for _ in range(16):
            k = n
            for _ in range(8):
                if pos + k > len(self.ids):
                    raise RuntimeError(f"the corpus ends before a window of {n} tokens at {offset}: read more")
                text = str(self.tok.decode(self.ids[pos:pos + k], clean_up_tokenization_spaces=False))
                if (m := self.count(text)) == n:
                    return text, pos + k
                k += n - m
            pos += 1
        raise RuntimeError(f"no window of exactly {n} tokens found from offset {offset}")
