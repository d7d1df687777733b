"""benchmarks/fidelity.py end to end on a tiny random model: every arm, a trained-recompute
module, the layer split and a training variant are trained, scored and recorded."""

import json
import sys

import pytest

from tests.benchmarks.scripts import load_script


@pytest.fixture(scope="module")
def fidelity():
    return load_script("fidelity")


def test_the_table_and_its_variants_are_recorded(fidelity, tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "fid"
    argv = ["fidelity.py", "--tasks", "retrieval", "--records", "4", "--key", "role+team", "--chains", "1",
            "--chain-length", "2", "--tools", "1", "--train", "8", "--eval", "6", "--rank", "2", "--alpha", "4",
            "--batch-size", "4", "--base", str(tiny_model_dir), "--out", str(out), "--quiet",
            "--train-recompute", "1", "--variant", "lr=1e-2,rank=4"]
    monkeypatch.setattr(sys, "argv", argv)
    fidelity.main()
    summary = json.loads((out / "fidelity.json").read_text())
    (res,) = summary["results"]
    assert set(res["accuracy"]) == {"base", "standard", "naive", "cache"}
    assert all(0.0 <= v <= 1.0 for v in res["accuracy"].values())
    assert res["difficulty"]["key"] == "role+team"
    # every wrong answer is classified, per arm
    preds = json.loads((out / "retrieval" / "predictions.json").read_text())["correct"]
    for arm, kinds in res["errors"].items():
        assert sum(kinds.values()) == preds[arm].count(False), arm
    rc = summary["trained_recompute"]["retrieval"]["1"]
    assert rc["k"] == 1 and rc["prefill_saved"] == round(1 - 1 / 3, 4) and rc["minus_standard"]["n"] == 6
    var = summary["variants"]["retrieval"]["lr=0.01,rank=4"]
    assert var["overrides"] == {"lr": 0.01, "rank": 4} and var["training"]["steps"] == 2
    trained = json.loads((out / "retrieval" / "cache-lr0.01-rank4" / "training.json").read_text())
    assert trained["config"]["lr"] == 0.01 and trained["config"]["rank"] == 4
    # the layer split: a rerun adds it without retraining what is done
    monkeypatch.setattr(sys, "argv", [*argv, "--layer-split"])
    fidelity.main()
    split = json.loads((out / "retrieval" / "trained_recompute.json").read_text())
    assert set(split) == {"1", "1-split"} and split["1-split"]["tuned_layers"] == 1
    assert split["1"] == rc
    # the report: one row per task, one per trained module, figures from the results
    table = fidelity.report([str(out)])
    assert f"| fid / retrieval | {100 * res['accuracy']['base']:.1f} %" in table
    assert "| fid / retrieval | k = 1-split | 66.7 % |" in table
    assert "| fid / retrieval | lr=0.01,rank=4 | 100.0 % |" in table


def test_a_bad_variant_names_the_knobs(fidelity):
    assert fidelity.parse_variant("lr=3e-3,rank=64") == {"lr": 0.003, "rank": 64}
    with pytest.raises(SystemExit, match="knobs lr, rank, alpha, epochs, recompute, layers"):
        fidelity.parse_variant("dropout=0.1")
