"""Every workload in open and closed loop against the real server on the tiny model, and
`agentshare bench` end to end."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from server.bench import Load, Options, bench, make_workload
from server.bench.text import Corpus
from tests.server.bench.test_workloads import write_trace

ROOT = Path(__file__).resolve().parents[3]
QUICK = dict(context=(48, 96), tool=(8, 16), think=(0.0, 0.05), output_tokens=4)


@pytest.fixture(scope="module")
def tiny_corpus(tiny_model_dir: Path) -> Corpus:
    from transformers import AutoTokenizer

    return Corpus(AutoTokenizer.from_pretrained(tiny_model_dir), tokens=20_000)


@pytest.mark.parametrize("load", [Load(rate=4.0), Load(concurrency=2)], ids=["open", "closed"])
@pytest.mark.parametrize("spec", ["react", "reflexion", "burst", "trace"])
def test_every_workload_runs_against_the_server(spec: str, load: Load, tiny_server_url: str, tiny_corpus: Corpus,
                                                tmp_path: Path) -> None:
    if spec == "trace":
        spec = "trace:" + str(write_trace(tmp_path / "trace.jsonl"))
    work = make_workload(spec, tiny_corpus, ["base", "coder"], steps=2, block_tokens=16, **QUICK)
    opts = Options(duration_s=0.5, max_sessions=3, warmup=1, progress=False, request_timeout_s=60)
    result = asyncio.run(bench(tiny_server_url, work, [load], opts))
    s = result["runs"][0]["summary"]
    per_session = {"react": 4, "reflexion": 6, "burst": 2}.get(spec, 1)
    assert s["failed"] == 0, s["errors"]
    assert s["sessions_completed"] == s["sessions"] >= 1 and s["completed"] == per_session * s["sessions"]
    assert s["short_answers"] == 0 and s["median_ttft_ms"] > 0 and s["request_throughput"] > 0
    if spec in ("react", "reflexion"):  # agents of one session read its context from one prefill
        assert s["cache_hit_ratio"] > 0.3
    sessions = result["runs"][0]["sessions"]
    assert len(sessions) == s["sessions"] and all(0 <= start < end and ok for start, end, ok in sessions)
    server = result["runs"][0]["server"]
    assert server["counters"]['agentshare_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= s["completed"]


def test_salt_per_agent_turns_sharing_off(tiny_server_url: str, tiny_corpus: Corpus) -> None:
    work = make_workload("burst", tiny_corpus, ["base", "coder"], **QUICK)
    hits = {}
    for salted in (False, True):
        opts = Options(duration_s=0.1, max_sessions=2, warmup=0, progress=False, salt_per_agent=salted, seed=11)
        result = asyncio.run(bench(tiny_server_url, work, [Load(concurrency=1)], opts))
        hits[salted] = result["runs"][0]["summary"]["cache_hit_ratio"]
    assert hits[False] > 0.3 and hits[True] < hits[False] / 2  # only the template's first block in common


def test_the_cli_end_to_end(tiny_server_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    out, plot = tmp_path / "r.json", tmp_path / "p.png"
    cmd = [sys.executable, "-m", "server.cli", "bench", "--url", tiny_server_url, "--workload", "react",
           "--agents", "base,coder", "--rate", "2,4", "--duration", "1", "--max-sessions", "2", "--steps", "2",
           "--context", "48-96", "--tool", "8-16", "--think", "0-0.05", "--output-tokens", "4",
           "--tokenizer", str(tiny_model_dir), "--slo", "ttft:60000", "--json", str(out), "--plot", str(plot),
           "--no-progress"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rate 2/s" in done.stdout and "rate 4/s" in done.stdout and f"wrote {out}" in done.stdout
    result = json.loads(out.read_text())
    assert [r["load"] for r in result["runs"]] == [{"mode": "open", "session_rate": 2.0},
                                                  {"mode": "open", "session_rate": 4.0}]
    assert result["command"].startswith("agentshare bench --url") and result["host"]["cpu"]
    assert all(r["summary"]["request_goodput"] > 0 and r["summary"]["failed"] == 0 for r in result["runs"])
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_the_cli_says_what_is_wrong(tiny_server_url: str, tiny_model_dir: Path) -> None:
    from typer.testing import CliRunner

    from server.cli import app

    for args, says in ((["--url", tiny_server_url, "--rate", "1", "--concurrency", "2"], "not both"),
                       (["--url", tiny_server_url, "--rate", "fast"], "comma-separated list"),
                       (["--url", tiny_server_url, "--workload", "chat", "--agents", "base"], "unknown workload"),
                       (["--url", tiny_server_url, "--agents", "nobody"], "does not serve nobody"),
                       (["--url", "http://127.0.0.1:9"], "cannot reach"),
                       (["--url", tiny_server_url, "--slo", "speed:1"], "one of ttft")):
        done = CliRunner().invoke(app, ["bench", "--tokenizer", str(tiny_model_dir), "--no-progress", *args])
        said = " ".join(re.sub(r"[│╭╮╰╯─]", " ", done.output).split())  # typer's box, unwrapped
        assert done.exit_code == 2 and says in said and "Traceback" not in said, (args, said[-600:])
