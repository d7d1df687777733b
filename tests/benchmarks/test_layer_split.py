"""benchmarks/layer_split.py end to end on the default model, small: it serves layer-split modules
from a pinned context and writes its JSON result (no timing is asserted: speed lives in the
recorded run)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_the_layer_split_benchmark_fills_from_the_pinned_context(tmp_path: Path) -> None:
    out = tmp_path / "split.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layer_split.py"), "--ks", "0,20", "--context", "256",
                    "--reps", "1", "--threads", "2", "--json", str(out)], cwd=ROOT, check=True, timeout=540)
    rows = {r["k"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[0]["filled_tokens"] == 0  # k = 0 reads the pinned blocks whole: nothing to recompute
    assert rows[20]["filled_tokens"] == 256  # its top 20 layers recomputed over the whole context
    assert rows[20]["predicted"] == pytest.approx(20 / 30)
    assert all(r["fill_s"] > 0 and r["private_s"] > 0 for r in rows.values())
