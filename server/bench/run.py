"""A benchmark run: each load in turn against one endpoint, summarized, with the host named.

>>> from transformers import AutoTokenizer
>>> from server.bench import Load, Options, bench, make_workload
>>> from server.bench.text import Corpus
>>> corpus = Corpus(AutoTokenizer.from_pretrained(model_dir), tokens=20_000)
>>> work = make_workload("react", corpus, ["base", "coder"], steps=2, context=(64, 96), tool=(8, 16),
...                      think=(0.0, 0.1), output_tokens=4)
>>> result = await bench(url, work, [Load(concurrency=2)],
...                      Options(duration_s=2, max_sessions=3, warmup=0, progress=False))
>>> s = result["runs"][0]["summary"]
>>> s["sessions_completed"], s["completed"], s["failed"], s["completion_tokens"]   # 3 sessions x 2 steps x 2 agents
(3, 12, 0, 48)
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import httpx

from server.bench.load import Load, Options, run_load
from server.bench.metrics import summarize, sustained
from server.bench.report import capacity
from server.bench.workloads import Workload
from server.engine.numerics import cpu_bf16, cpu_model, physical_cores


def host() -> dict[str, Any]:
    """The machine the client ran on (the server's, when both share it)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return {"cpu": cpu_model(), "bf16": cpu_bf16(), "logical_cpus": cpus, "physical_cores": physical_cores(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "platform": platform.platform(),
            "python": platform.python_version()}


async def served_models(url: str, api_key: str | None = None) -> list[str]:
    """The model names ``url``/v1/models lists; raises ``RuntimeError`` saying what to do when the
    server cannot be reached or answers otherwise."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            r = await client.get(f"{url}/v1/models", headers=headers)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot reach {url} ({type(exc).__name__}: {exc}): start a server "
                           "(`agentshare serve`) or give its root with --url") from None
    if r.status_code != 200:
        raise RuntimeError(f"{url}/v1/models answered HTTP {r.status_code}: {r.text[:200]} "
                           "(an API key? --api-key)")
    return [m["id"] for m in r.json().get("data", [])]


async def bench(url: str, workload: Workload, loads: Sequence[Load], opts: Options, *,
                slo: Mapping[str, float] | None = None, label: str | None = None,
                command: Sequence[str] | None = None) -> dict[str, Any]:
    """Run ``workload`` at each load in turn against ``url`` (an OpenAI-compatible server's root:
    agentshare in either engine, vLLM, or another), then summarize each run
    (:func:`server.bench.metrics.summarize`) and judge whether it held its rate
    (:func:`server.bench.metrics.sustained`). The result is what ``--json`` writes."""
    url = url.rstrip("/")
    models = await served_models(url, opts.api_key)
    missing = sorted(set(workload.agents) - set(models))
    if missing:
        raise RuntimeError(f"{url} does not serve {', '.join(missing)}; it serves {', '.join(models) or 'nothing'} "
                           "(--agents names them)")
    out: dict[str, Any] = {
        "label": label or url, "endpoint": url,
        "command": shlex.join(command if command is not None else sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": host(),
        "workload": workload.describe(),
        "options": {k: v for k, v in asdict(opts).items() if k != "api_key"},
        "slo_ms": dict(slo or {}), "runs": [],
    }
    for load in loads:
        run = await run_load(url, workload, load, opts)
        summary = summarize(run.results, run.sessions, t0=run.t0, last_arrival=run.last_arrival, slo=slo,
                            offered_rate=load.rate)
        out["runs"].append({"load": load.describe(), "summary": summary, "sustained": list(sustained(summary)),
                            "server": run.server,
                            # each measured session: start and end (seconds from the measured phase's
                            # start) and whether it completed, for analyses after the run
                            "sessions": [[round(x.start - run.t0, 3), round(x.end - run.t0, 3), x.ok]
                                         for x in run.sessions if not x.warmup]})
    out["capacity"] = capacity(out["runs"])
    return out
