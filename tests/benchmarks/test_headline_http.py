"""benchmarks/headline_http.py end to end, quick and without vLLM: it launches the real server,
runs every agentshare arm over HTTP and records what each request read from cache. On the default
model (tier bench) and on the tiny model (its twin, the default tier)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def quick_headline(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "headline.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "headline_http.py"), "--quick", "--skip-vllm",
                    "--json", str(out), *args], cwd=ROOT, check=True, timeout=840)
    return json.loads(out.read_text())


def check(result: dict) -> None:
    assert result["versions"]["vllm_skipped"]
    ours = result["servers"]["agentshare"]
    context = result["config"]["context"]
    for arm in ("base", "lora_shared", "lora_private"):
        (run,) = ours["headline"][arm]
        assert run["completion_tokens"] == [result["config"]["out_tokens"]] * 3 and run["wall_s"] > 0
        cached = sorted(run["cached_tokens"])
        # one request prefills the context and two read it, unless each agent is its own tenant
        assert cached == ([0, 0, 0] if arm == "lora_private" else [0, context, context]), (arm, cached)
    assert all(v["tok_s"] > 0 for v in ours["prefill"].values())
    assert set(ours["decode"]) == {"1", "4"}


@pytest.mark.timeout(900)
def test_the_quick_headline_runs_every_arm_and_sharing_shows_in_the_cached_tokens(tmp_path: Path, default_model: Path) -> None:
    result = quick_headline(tmp_path)
    assert result["config"]["out_tokens"] == 64
    check(result)


@pytest.mark.timeout(300)
def test_twin_on_the_tiny_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    check(quick_headline(tmp_path, "--model", str(tiny_model_dir), "--dtype", "float32", "--settle", "0",
                         "--out-tokens", "8"))
