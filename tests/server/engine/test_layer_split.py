"""The layer split in the engine: a LoRA module that recomputes the prefix KV of its top k
layers (``recompute_layers`` in its manifest) against the training-time reference path
(``SplitModel(recompute=k)``), in fp32, on the tiny 3-layer model."""

from __future__ import annotations

import pytest
import torch

from server.engine.sampling import SamplingParams
from server.prompt import chat_prompt
from server.training.dataset import Batch
from server.training.split import SplitModel
from tests.server.engine.test_core import CONTEXT, FORCED, drain, engine, forced, turn

ATOL = 2e-4


def reference(tiny_model_dir, module_dir, k: int, tokens: list[int], ip: int, n_rows: int) -> torch.Tensor:
    """Logits of the last ``n_rows`` positions as fine-tuning computes them: the base over
    ``tokens[:ip]``, the module's top ``k`` layers recomputed over them from the base's hidden
    state, then the module over the rest."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    module = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                       module_dir).eval()
    n = len(tokens)
    batch = Batch(torch.tensor([tokens]), torch.ones(1, n, dtype=torch.long), torch.arange(n)[None],
                  torch.full((1, n - ip), -100), ip)
    split = SplitModel(module, recompute=k)
    with torch.no_grad():
        h = split.suffix_hidden(batch, split.prefix(batch))
        return module.get_base_model().lm_head(h[0, -n_rows:])


@pytest.fixture(scope="module")
def split_dirs(make_lora):
    return {k: make_lora(f"split{k}", seed=5, recompute_layers=k) for k in (1, 2)}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("family_cached", [True, False], ids=["filled", "computed"])
def test_a_split_module_equals_the_training_reference(tiny_model_dir, smollm2_tokenizer, split_dirs, k,
                                                       family_cached):
    core, logits = engine(tiny_model_dir, {"m": split_dirs[k]})
    prompt = chat_prompt(smollm2_tokenizer, CONTEXT, turn("Which item is 5?"))
    ip = prompt.invocation_point(core.modules["m"].placement)
    if family_cached:  # the base prefilled the context: the module fills its prefix from it
        core.add_context("ctx", prompt.token_ids[: prompt.context_len], ttl=60)
        drain(core)
    core.add_request("r", "m", prompt, forced())
    drain(core)
    full = ip // 16 * 16
    assert core.stats.recomputed_prefix_tokens == (full if family_cached else 0)
    assert core.stats.split_saved_layer_rows == (full * (3 - k) if family_cached else 0)
    want = reference(tiny_model_dir, split_dirs[k], k, list(prompt.token_ids) + list(FORCED[:-1]), ip, len(FORCED))
    got = torch.stack(logits["r"])
    assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()
    # and it is not the module at full sharing: the recompute changed the logits
    plain = reference(tiny_model_dir, split_dirs[k], 0, list(prompt.token_ids) + list(FORCED[:-1]), ip, len(FORCED))
    assert (plain - want).abs().max() > 10 * ATOL
