"""benchmarks/layer_split.py end to end, small: it serves layer-split modules from a pinned
context and writes its JSON result (no timing is asserted: speed lives in the recorded run). On
the default model (tier bench) and on the tiny model (its twin, the default tier)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, *args: str) -> dict[int, dict]:
    out = tmp_path / "split.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layer_split.py"), "--context", "256",
                    "--reps", "1", "--threads", "2", "--json", str(out), *args], cwd=ROOT, check=True, timeout=540)
    return {r["k"]: r for r in json.loads(out.read_text())["rows"]}


def check(rows: dict[int, dict], k: int, layers: int) -> None:
    assert rows[0]["filled_tokens"] == 0  # k = 0 reads the pinned blocks whole: nothing to recompute
    assert rows[k]["filled_tokens"] == 256  # its top k layers recomputed over the whole context
    assert rows[k]["predicted"] == pytest.approx(k / layers)
    assert all(r["fill_s"] > 0 and r["private_s"] > 0 for r in rows.values())


@pytest.mark.timeout(600)
def test_the_layer_split_benchmark_fills_from_the_pinned_context(tmp_path: Path, default_model: Path) -> None:
    check(run(tmp_path, "--ks", "0,20"), 20, 30)


@pytest.mark.timeout(300)
def test_twin_on_the_tiny_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    check(run(tmp_path, "--ks", "0,2", "--model", str(tiny_model_dir), "--dtype", "float32"), 2, 3)
