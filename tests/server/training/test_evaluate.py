"""Evaluation through the serving engine gives the reference path's answers (fp32, tiny model)."""

from __future__ import annotations

from server.training.dataset import parse_row
from server.training.evaluate import Arm, answers, engine_answers, load_split
from server.training.tasks import Difficulty, generate

SMALL = Difficulty(records=3, chains=1, chain_length=2, tools=1)


def test_the_engine_answers_as_the_reference_path_does(tiny_model_dir, make_lora, smollm2_tokenizer):
    """A module with a family manifest decodes from the base's shared prefill in the engine and
    from the base's prefix KV in the reference path; a standard one (no manifest) from its own
    prefill in both. Same greedy answers, example by example."""
    shared = make_lora("eval-shared", seed=3)
    private = make_lora("eval-private", seed=4, manifest=False)
    rows = [parse_row(r) for r in generate("retrieval", 5, difficulty=SMALL)]
    got = engine_answers(tiny_model_dir, {"shared": shared, "private": private}, rows, dtype="float32",
                         max_new_tokens=6, kv_cache_bytes=32 << 20)
    arms = {"base": Arm(load_split(tiny_model_dir), shared=True),
            "shared": Arm(load_split(tiny_model_dir, shared), shared=True),
            "private": Arm(load_split(tiny_model_dir, private), shared=False)}
    want = answers(arms, rows, smollm2_tokenizer, batch_size=5, max_new_tokens=6)
    assert got == want
    assert got["shared"] != got["private"]
