"""``scripts/device-check`` end to end on the CPU (``--quick``): the GPU check is ready for the
first machine with a device, its tests pass without the repository's conftest files, and its
JSON holds every figure with the transformers figure beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_device_check_runs_its_tests_and_writes_every_figure(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([str(ROOT / "scripts" / "device-check"), "--quick", "--device", "cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "tests.log").read_text()
    assert " passed" in log and "failed" not in log, log  # the CPU cases ran; the cuda ones skip here
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert result["tests_rc"] == 0 and result["device"] == "cpu" and not result["skipped"]
    tiny = result["shapes"]["tiny"]
    for key in ("prefill_64", "prefill_128", "decode_1", "decode_4"):
        assert tiny[key]["engine_tok_s"] > 0 and tiny[key]["transformers_tok_s"] > 0, key
        assert tiny[key]["limit_tok_s"] is None  # no limits table for a CPU
    h = tiny["headline_3"]
    assert h["agents"] == 3 and h["shared_s"] > 0 and h["private_s"] > 0 and h["predicted"] > 1
    agree = result["bf16_agreement"]
    assert agree["positions"] == 2 * 4 and 0 <= agree["same_greedy"] <= agree["positions"]
