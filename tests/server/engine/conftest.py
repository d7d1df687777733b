"""Engine fixtures: the oracle a request is judged by (docs/design.md §2)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def oracle(tiny_model_dir: Path) -> Callable[..., torch.Tensor]:
    """``oracle(module_dir|None, kind, tokens, ip, n_rows)``: transformers runs the base over
    ``tokens[:ip]``; the module continues from those past_key_values over ``tokens[ip:]``.
    Returns the logits [n_rows, vocab] of the last ``n_rows`` positions."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def module_model(path: Path | None, kind: str) -> torch.nn.Module:
        if path is None:
            return base
        if kind == "lora":
            from peft import PeftModel

            fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
            return PeftModel.from_pretrained(fresh, path).eval()
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def run(path: Path | None, kind: str, tokens: Sequence[int], ip: int, n_rows: int) -> torch.Tensor:
        module = module_model(path, kind)
        ids = torch.tensor([list(tokens)])
        with torch.no_grad():
            if ip > 0:
                cache = base(ids[:, :ip], use_cache=True).past_key_values
                out = module(ids[:, ip:], past_key_values=cache, use_cache=True)
            else:
                out = module(ids)
        return out.logits[0, -n_rows:]

    return run
