"""benchmarks/heldout_families.py end to end on the tiny model: a held-out family's own and shared
modules answered through the engine and paired, a joint base that leaves the held-out families out,
perplexity, and the report."""

import json
import sys

import pytest

from tests.benchmarks.scripts import load_script


@pytest.mark.timeout(600)
def test_a_family_is_paired_and_the_joint_stage_leaves_the_held_out_families_out(tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    script = load_script("heldout_families")
    out = tmp_path / "hf"

    def run(*args: str) -> None:
        monkeypatch.setattr(sys, "argv", ["heldout_families.py", *args, "--out", str(out), "--quiet"])
        script.main()

    run("--families", "counting", "--base", str(tiny_model_dir), "--tag", "before", "--train", "8",
        "--held-out", "6")
    result = json.loads((out / "before" / "counting" / "result.json").read_text())
    assert set(result["accuracy"]) == {"base", "own", "shared"} and result["shared_minus_own"]["n"] == 6
    assert result["train_seconds"]["own"] > 0 and result["train_seconds"]["shared"] > 0

    run("--stage", "joint", "--joint-from", str(tiny_model_dir), "--hold-out", "counting,lookup",
        "--joint-rows", "1", "--joint-epochs", "1")
    tasks = {json.loads(line)["task"] for line in (out / "joint-mixture.jsonl").read_text().splitlines()}
    assert "counting" not in tasks and "lookup" not in tasks and {"lm", "tool", "copying"} <= tasks
    assert (out / "joint" / "agentshare-joint.json").is_file()

    run("--stage", "perplexity", "--bases", f"tiny={tiny_model_dir},joint={out / 'joint'}", "--ppl-tokens", "600")
    ppl = json.loads((out / "perplexity.json").read_text())
    assert set(ppl) == {"tiny", "joint"} and all(v > 1 for r in ppl.values() for v in r.values())

    run("--stage", "report", "--json", str(out / "r.json"))
    doc = json.loads((out / "r.json").read_text())
    assert [r["family"] for r in doc["results"]] == ["counting"] and doc["joint"] and doc["perplexity"]
    with pytest.raises(SystemExit, match="not a family the team base left out"):
        run("--families", "table-name", "--base", str(tiny_model_dir))
