"""The real SmolLM2-135M-Instruct tokenizer (with chat template), read from its GGUF once per
process.

Once per process, not per pytest session: scripts/mutation runs one session per mutant, each in
a process forked from one that has read it already (reading it takes about 7 CPU-seconds).
Pytest imports conftest files afresh in every session, so the cache lives in this module.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from server.models.loader import default_gguf_path

    gguf = default_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
