"""benchmarks/graph_noise.py end to end on a tiny shape: it writes both figures, and in fp32 the
padded step equals the eager one far inside the fp32 replay tolerance."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_graph_noise_benchmark_writes_both_figures(tmp_path: Path, dtype: str) -> None:
    out = tmp_path / "noise.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "graph_noise.py"), "--shape", "tiny", "--dtype", dtype,
                    "--threads", "2", "--json", str(out)], cwd=ROOT, check=True, timeout=280)
    result = json.loads(out.read_text())
    assert set(result["padded_vs_eager"]) == {"agent0", "agent1", "agent2"} and result["layers"] == 2
    figures = [*result["padded_vs_eager"].values(), result["alone_vs_batched"]]
    assert all(0 <= f < 0.1 for f in figures)
    if dtype == "float32":
        assert max(figures) < 1e-5
