"""``scripts/device-check`` end to end on the CPU (``--quick``): the GPU check is ready for the
first machine with a device, its tests pass without the repository's conftest files, and its
JSON holds every figure with the transformers figure beside it.

The GPU machine has torch and transformers but not this project installed: the check runs here
under a Python that does not see the editable install either (``-S``, the site-packages on
``PYTHONPATH`` without their ``.pth`` files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_device_check_runs_its_tests_and_writes_every_figure(tmp_path: Path) -> None:
    bare = tmp_path / "python"  # no site: the project's editable install is out of sight
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    env = {**os.environ, "PYTHON": str(bare), "PYTHONPATH": sysconfig.get_paths()["purelib"], "OUT": str(tmp_path),
           "OMP_NUM_THREADS": "2"}
    probe = subprocess.run([str(bare), "-c", "import server"], cwd=tmp_path, env=env, capture_output=True)
    assert probe.returncode != 0  # the stand-in for the GPU machine does not see the project
    proc = subprocess.run([str(ROOT / "scripts" / "device-check"), "--quick", "--device", "cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "tests.log").read_text()
    assert " passed" in log and "failed" not in log, log  # the CPU cases ran; the cuda ones skip here
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert result["tests_rc"] == 0 and result["device"] == "cpu" and not result["skipped"]
    assert result["errors"] == {} and result["engine_warnings"] == []
    tiny = result["shapes"]["tiny"]
    assert "prefill_64_one_step" not in tiny  # 64 tokens fit one step of the quick plan's engine
    for key in ("prefill_64", "prefill_128", "prefill_128_one_step", "decode_1", "decode_1_eager", "decode_4"):
        assert tiny[key]["engine_tok_s"] > 0 and tiny[key]["transformers_tok_s"] > 0, key
        assert tiny[key]["limit_tok_s"] is None  # no limits table for a CPU
    assert tiny["decode_1"]["graphs"] == "none" and tiny["decode_1_eager"]["replays"] == 0  # no graphs on a CPU
    for key, graphs in (("headline_3", "auto"), ("headline_3_eager", "off")):
        h = tiny[key]
        assert h["agents"] == 3 and h["graphs"] == graphs and h["shared_s"] > 0 and h["private_s"] > 0
        assert h["predicted"] > 1
    agree = result["bf16_agreement"]
    assert agree["positions"] == 2 * 4 and 0 <= agree["same_greedy"] <= agree["positions"]
