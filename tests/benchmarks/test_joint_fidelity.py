"""benchmarks/joint_fidelity.py end to end on the tiny model: the joint base, arms (2), (4), (6)
and (7) trained, answered through the engine on the same held-out rows, and paired to (2)."""

import json
import sys

import pytest

from tests.benchmarks.scripts import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("joint_fidelity")


@pytest.mark.timeout(600)
def test_every_arm_is_paired_to_the_standard_module(script, tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "jf"
    common = ["--base", str(tiny_model_dir), "--out", str(out), "--settings", "team8", "--train", "8",
              "--eval", "6", "--joint-rows", "4", "--threads", "2", "--quiet"]

    def run(*args: str) -> dict:
        monkeypatch.setattr(sys, "argv", ["joint_fidelity.py", *args, *common, "--json", str(out / "r.json")])
        script.main()
        return json.loads((out / "r.json").read_text())

    r = run("--stage", "raw", "--raw-arms", "standard")  # (2) alone; (4) joins it on the next run
    assert set(r["results"]["team8"]["accuracy"]) == {"standard"}
    run("--stage", "raw")
    run("--stage", "shared")
    r = run("--stage", "recompute", "--k", "team8=1")
    res = r["results"]["team8"]
    assert set(res["accuracy"]) == {"standard", "cache", "joint", "joint-own", "joint-k1"}
    assert set(res["minus_standard"]) == {"cache", "joint", "joint-own", "joint-k1"}
    assert all(d["n"] == 6 for d in res["minus_standard"].values())  # the same six held-out rows, paired
    for arm, acc in res["accuracy"].items():  # every wrong answer classified
        assert sum(res["errors"][arm].values()) == round(6 * (1 - acc)), arm
    assert set(res["minus_cache"]) == {"joint", "joint-own", "joint-k1"} and res["minus_cache"]["joint"]["n"] == 6
    # the joint stage trained one decode adapter per setting (and tool calling), from rows of its own seed
    assert sorted(r["joint_bases"]["joint"]["tasks"]) == ["name16", "planning", "team8", "tool"]
    mixture = [json.loads(x) for x in (out / "joint-mixture.jsonl").read_text().splitlines()]
    held = {json.loads(x)["context"] for x in (out / "team8" / "eval.jsonl").read_text().splitlines()}
    assert not held & {row["context"] for row in mixture}
    # a new base is a new family; its modules name it, the original base's modules do not
    joint = json.loads((out / "joint-base" / "agentshare-joint.json").read_text())
    assert joint["family"] != joint["from_family"]
    manifest = json.loads((out / "team8" / "joint-k1" / "agentshare-module.json").read_text())
    assert manifest["recompute_layers"] == 1 and manifest["family"] == joint["family"]
    assert not (out / "team8" / "joint-own" / "agentshare-module.json").exists()  # its own prefill
    # three agents, one at k layers recomputed of 3: (3 + 2·1) / 9 of the private prefills
    assert res["training"]["joint-k1"]["prefill_saved_3_agents"] == pytest.approx(1 - 5 / 9, abs=1e-4)
    assert res["training"]["joint"]["prefill_saved_3_agents"] == pytest.approx(2 / 3, abs=1e-4)
    assert "prefill_saved_3_agents" not in res["training"]["standard"]  # its own prefill: it shares none
    # another mixture is another base, and its arms are named after it
    r = run("--stage", "shared", "--joint-mix", "team8", "--no-own")
    assert sorted(r["joint_bases"]) == ["joint", "joint-team8"] and r["joint_bases"]["joint-team8"]["tasks"] == ["team8"]
    assert "joint-team8" in r["results"]["team8"]["accuracy"]
    assert "joint-team8-own" not in r["results"]["team8"]["accuracy"]
    # another budget of a mixture is named on the command line: a base and arms of its own
    r = run("--stage", "shared", "--joint-mix", "team8", "--joint-epochs", "1", "--joint-name", "joint-long", "--no-own")
    assert (r["joint_bases"]["joint-long"]["epochs"], r["joint_bases"]["joint-team8"]["epochs"]) == (1.0, 0.5)
    assert "joint-long" in r["results"]["team8"]["accuracy"]
    # (2'): a standard module on its rows plus the joint mixture's rows of the setting, the joint arms paired to it
    r = run("--stage", "raw", "--raw-arms", "standard-equal")
    res = r["results"]["team8"]
    assert res["training"]["standard-equal"]["steps"] == 2 * res["training"]["standard"]["steps"]  # 8 + 4 rows
    equal = [json.loads(x)["context"] for x in (out / "team8" / "train-equal-4-2.jsonl").read_text().splitlines()]
    train = [json.loads(x)["context"] for x in (out / "team8" / "train.jsonl").read_text().splitlines()]
    mixed = [row["context"] for row in mixture if row["task"] == "team8"]
    assert equal == train + mixed
    assert set(res["minus_equal"]) == {"joint", "joint-own", "joint-k1", "joint-team8", "joint-long"}
    assert res["minus_equal"]["joint"]["n"] == 6
    with pytest.raises(SystemExit):
        run("--stage", "raw", "--raw-arms", "standard,private")
