"""The three-agent demo runs end to end: on the tiny model by default, on the real default model
(what `scripts/demo` runs) in the model tier."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "three_agents.py"


def run_demo(*args: str, timeout: float) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=timeout, check=False,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def check(out: str, reps: int = 3) -> None:
    for agent in ("retrieval", "planning", "coding"):
        assert f"── {agent} (" in out
    assert "prefill tokens computed" in out and "sharing saved" in out
    on, off = (int(x.replace(",", "")) for x in out.split("prefill tokens computed")[1].split()[:2])
    split_on = int(out.split("top layers only (split)")[1].split()[0].replace(",", ""))
    # three private prefills of the report vs one shared (layer-split agents recompute their top
    # layers over the shared report: those positions are counted apart)
    assert off > 2.5 * (on - split_on)
    assert "DESIGN" not in out and "§" not in out  # the closing line cites nothing outside the repository
    # nothing cold is timed: a warm-up of each arm, then the arms alternating, every repetition shown
    assert f"one untimed repetition of each arm, then {reps} of each, alternating:" in out
    timed = [line.split(":")[0] for line in out.splitlines() if re.match(r"  sharing o(n|ff): +[0-9.]+ s \(", line)]
    assert timed == ["  sharing on", "  sharing off"] * (reps + 1)
    walls = out.split("each repetition, in the order run")[1].splitlines()[0].split()
    assert len(walls) == 2 * reps and all(float(x) > 0 for x in walls)
    assert f"wall time, s, median of {reps}" in out and "measured on " in out
    assert "before the timed runs, not in them: model " in out and "server start " in out


@pytest.mark.timeout(300)  # four rounds of both arms: 15-40 s on a 2-core host beside other tests
def test_demo_on_the_tiny_model(tiny_model_dir: Path) -> None:
    out = run_demo("--model", str(tiny_model_dir), "--dtype", "float32", "--max-tokens", "4", timeout=240)
    check(out)
    assert "answers identical with and without sharing: yes." in out  # fp32: sharing changes nothing


@pytest.mark.timeout(660)
def test_demo_on_the_default_model(default_model: Path) -> None:
    out = run_demo("--max-tokens", "16", "--dtype", "bfloat16", "--reps", "1", timeout=600)
    check(out, reps=1)
    assert "base model: " + str(ROOT / "examples" / "modules" / "team-base") in out  # the shipped team's base
    # bf16: the closing line says why answers may differ, with the recorded agreement figures
    closing = " ".join(out.split("answers identical with and without sharing:")[1].split())
    assert "summed in another order" in closing and "pick the same next token" in closing, closing
    assert "benchmarks/recorded/bf16_agreement.json" in closing


@pytest.mark.timeout(360)
def test_the_demo_scores_a_trained_team_on_episodes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With trained modules (here random tiny ones, with a recorded held-out figure beside each),
    the demo serves them, then scores the team on held-out episodes, sharing on against each
    module on its own prefill, and says what the layer split saved."""
    import dataclasses
    import json

    from server.kv.family import family_digest
    from server.modules.manifest import Manifest
    from tests.server.api.conftest import make_lora_module

    family = family_digest(tiny_model_dir, kv_dtype="float32")
    for seed, (agent, k) in enumerate((("retrieval", 2), ("planning", 1), ("coding", 0))):
        d = make_lora_module(tiny_model_dir, tmp_path / agent, agent, family, seed=seed + 1)
        dataclasses.replace(Manifest.read(d), recompute_layers=k).write(d)
        (d / "heldout.json").write_text(json.dumps({"recompute_layers": k, "heldout": {
            "examples": 300, "accuracy": {"shared": 0.5, "own_prefill": 0.5}}}))
    out = run_demo("--model", str(tiny_model_dir), "--dtype", "float32", "--max-tokens", "4",
                   "--modules", str(tmp_path), "--episodes", "2", "--reps", "1", timeout=300)
    check(out, reps=1)
    table = out.split("held-out episodes (generated scenarios")[1]
    for agent, split in (("retrieval (retrieval)", "top 2 of 3"), ("planning (planning)", "top 1 of 3"),
                         ("coding (tool)", "none")):
        line = next(x for x in table.splitlines() if x.startswith(agent))
        assert split in line and "50.0% / 50.0% of 300" in line, line
    saved = int(table.split("prefill work")[1].split("saved")[0].split(":")[-1].strip().rstrip("%"))
    assert 0 < saved < 100
    recomputed = int(table.split("sharing on: ")[1].split()[0].replace(",", ""))
    assert recomputed > 0  # the split agents filled their prefix from the pinned context


def test_the_demo_builds_the_fused_kernels_before_anything_is_timed(tiny_model_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare() runs the kernels' builder for the served model's shape and dtype, in the
    foreground, before the server starts, and reports its time as a first-run cost; once they are
    built (or with AGENTSHARE_FUSED=off) it builds nothing. The build itself is tested for real in
    tests/server/engine/test_elementwise.py (tier model)."""
    import json

    from server.engine import elementwise

    monkeypatch.syspath_prepend(str(DEMO.parent))
    monkeypatch.setenv("AGENTSHARE_CACHE_DIR", str(tmp_path))
    import three_agents

    ran: list[list[str]] = []
    monkeypatch.setattr(three_agents.subprocess, "run", lambda cmd, check: ran.append(cmd))
    monkeypatch.setenv("AGENTSHARE_FUSED", "auto")
    costs = three_agents.prepare(str(tiny_model_dir), "float32")
    (cmd,) = ran
    assert cmd[1:5] == ["-m", "server.engine.elementwise", "build", "--spec"]
    assert json.loads(cmd[5]) == {"hidden": 256, "heads": 6, "head_dim": 64, "qkv_width": 512, "intermediate": 512,
                                  "eps": pytest.approx(1e-5), "dtype": "float32"}
    assert set(costs) == {"model", "fused kernels"}
    monkeypatch.setattr(elementwise, "load", lambda spec: object())  # built: nothing to do
    assert set(three_agents.prepare(str(tiny_model_dir), "float32")) == {"model"} and len(ran) == 1
    monkeypatch.setenv("AGENTSHARE_FUSED", "off")
    monkeypatch.setattr(elementwise, "load", lambda spec: None)
    assert set(three_agents.prepare(str(tiny_model_dir), "float32")) == {"model"} and len(ran) == 1
