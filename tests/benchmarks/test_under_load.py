"""benchmarks/under_load.py end to end on the tiny model (its twin in the default tier; the full
sweep runs for hours and is recorded, not tested): every arm's real server started, driven through
the same sessions, compared and plotted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_twin_on_the_tiny_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    out, plot = tmp_path / "under_load.json", tmp_path / "under_load.png"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "under_load.py"), "--model", str(tiny_model_dir),
                    "--dtype", "float32", "--rates", "2", "--duration", "2", "--context", "48-96", "--steps", "2",
                    "--think", "0-0.1", "--output-tokens", "4", "--kv-budget", "16MiB", "--no-progress",
                    "--json", str(out), "--plot", str(plot)], cwd=ROOT, check=True, timeout=280)
    res = json.loads(out.read_text())
    assert list(res["arms"]) == ["shared", "private", "base"] and res["kv_budget_bytes"] == 16 << 20
    summaries = {arm: a["runs"][0]["summary"] for arm, a in res["arms"].items()}
    for arm, s in summaries.items():
        assert s["failed"] == 0 and s["completed"] == 6 * s["sessions"] > 0, (arm, s["errors"])  # 3 agents x 2 steps
        assert "--kv-cache" in res["arms"][arm]["command"] and str(16 << 20) in res["arms"][arm]["command"]
    # the same sessions in every arm (the same arrivals; the prompts differ only by the answers)
    assert len({s["sessions"] for s in summaries.values()}) == 1
    # sharing off: each agent prefills the context itself; on: one prefill serves the three
    assert summaries["private"]["cache_hit_ratio"] < summaries["shared"]["cache_hit_ratio"] / 1.5
    assert set(res["comparison"]["by_rate"]["2"]) == {"shared", "private", "base"}
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_the_arms_commands_share_one_kv_budget(tmp_path: Path) -> None:
    ul = load_script("under_load")
    args = ul.parse_args(["--arms", ",".join(ul.ARMS)])
    modules = {f"agent{i}": tmp_path / f"agent{i}" for i in range(3)}

    def option(cmd: list[str], name: str) -> int:
        return int(cmd[cmd.index(name) + 1])

    budget = 3 << 27
    cmds = {arm: ul.server_command(arm, args, tmp_path, modules, 8000, budget, "vpy")[0] for arm in ul.ARMS}
    for arm in ("shared", "private", "base"):
        assert option(cmds[arm], "--kv-cache") == budget
    for arm in ("vllm-lora", "vllm-base"):
        assert option(cmds[arm], "--kv-cache-memory-bytes") == budget and "--enable-prefix-caching" in cmds[arm]
    assert "--enable-lora" in cmds["vllm-lora"] and "--enable-lora" not in cmds["vllm-base"]
    # two instances (the base's, the LoRA modules') and the prefix store: a third each
    assert option(cmds["agentshare-vllm"], "--kv-cache") * 3 == option(cmds["agentshare-vllm"], "--kv-store") * 3 == budget
    assert ul.agents_of("base", modules, 3) == ["base"] * 3 and ul.agents_of("shared", modules, 3) == list(modules)
    with pytest.raises(SystemExit):
        ul.parse_args(["--arms", "shared,sglang"])
    quick = ul.parse_args(["--quick"])
    assert (quick.arm_list, quick.rate_list, quick.agents) == (["shared", "private", "base"], [0.1, 0.15, 0.2], 3)
