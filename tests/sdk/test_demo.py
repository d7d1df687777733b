"""The three-agent demo runs end to end: on the tiny model by default, on the real default model
(what `scripts/demo` runs) with -m slow."""

from __future__ import annotations

import os
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


def check(out: str) -> None:
    for agent in ("retrieval", "planning", "coding"):
        assert f"── {agent} (" in out
    assert "prefill tokens computed" in out and "sharing saved" in out
    on, off = (int(x.replace(",", "")) for x in out.split("prefill tokens computed")[1].split()[:2])
    assert off > 2.5 * on  # three private prefills of the report vs one shared
    assert "DESIGN" not in out and "§" not in out  # the closing line cites nothing outside the repository


def test_demo_on_the_tiny_model(tiny_model_dir: Path) -> None:
    out = run_demo("--model", str(tiny_model_dir), "--dtype", "float32", "--max-tokens", "4", timeout=240)
    check(out)
    assert "answers identical with and without sharing: yes." in out  # fp32: sharing changes nothing


@pytest.mark.slow
def test_demo_on_the_default_model() -> None:
    out = run_demo("--max-tokens", "16", "--dtype", "bfloat16", timeout=600)
    check(out)
    # bf16: the closing line says why answers may differ, with the recorded agreement figures
    closing = " ".join(out.split("answers identical with and without sharing:")[1].split())
    assert "summed in another order" in closing and "pick the same next token" in closing, closing
    assert "benchmarks/recorded/bf16_agreement.json" in closing
