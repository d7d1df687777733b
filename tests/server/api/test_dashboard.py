"""The Grafana dashboard of ``examples/observability/``: its structure, and every metric its PromQL
reads is one a real ``/metrics`` exposes, suffix included (``_total``, ``_bucket``): the colocated
server's, scraped after a generation, and the router's own figures (:class:`RouterCollector`
over stand-in workers, as its doctest does), so a renamed metric fails here, not on a blank
panel."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from server.cluster.messages import LinkFigures, WorkerStats
from server.cluster.metrics import RouterCollector, RouterStats

DASHBOARD = Path(__file__).parents[3] / "examples" / "observability" / "agentshare-dashboard.json"
PROMETHEUS_YML = DASHBOARD.with_name("prometheus.yml")
DS = "${DS_PROMETHEUS}"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
             "unless", "inf", "nan"}
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
             "summary": ("_sum", "_count", "")}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (not its functions, keywords, labels, durations).

    >>> sorted(metric_names('histogram_quantile(0.9, sum by (le, agent) (rate(a_bucket{job=~"$job",x="y(z)"}[1m])))'
    ...                     ' / on (job) group_left sum(b_total offset 5m) + c'))
    ['a_bucket', 'b_total', 'c']
    """
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # label values may hold anything
    e = re.sub(r"\{[^{}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\[\]]*\]", " ", e)  # range selectors, $__range
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", e)  # label lists
    e = re.sub(r"\boffset\s+\S+", " ", e)
    names = set()
    for m in _NAME.finditer(e):
        if e[m.end():].lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue  # a function (or an aggregation)
        if m.start() and (e[m.start() - 1].isdigit() or e[m.start() - 1] in "$."):
            continue  # the exponent of a number, a Grafana variable
        names.add(m.group())
    return names


def exposed_series(text: str) -> dict[str, str]:
    """``{series name: family}`` of a Prometheus text exposition: each family its ``# TYPE`` declares,
    with its type's suffixes (a family without samples yet still counts), and every sample's name."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            family = name.removesuffix("_total") if kind == "counter" else name
            out.update({family + s: family for s in _SUFFIXES.get(kind, ("",))})
        elif line and not line.startswith("#"):
            name = _NAME.match(line)
            assert name is not None, line
            out.setdefault(name.group(), name.group())
    return out


def unknown_metrics(exprs: list[str], series: dict[str, str]) -> list[str]:
    """What a dashboard's expressions read that the exposition lacks, each with what it may have meant."""
    families = set(series.values())
    bad = []
    for expr in exprs:
        for name in sorted(metric_names(expr) - series.keys()):
            stem = re.sub(r"_(total|bucket|sum|count)$", "", name)
            hint = f" (the family {stem} has {sorted(k for k, f in series.items() if f == stem)})" \
                if stem in families else ""
            bad.append(f"{name}{hint} in {expr}")
    return bad


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL of the dashboard: its panels' targets and its query variables."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":  # Grafana's label_values(selector, label): the selector is PromQL
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", v["definition"])
            assert m is not None, f"variable {v['name']}: not label_values(selector, label)"
            exprs.append(m.group(1))
    return exprs


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row holds its own


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def server_exposition(start_server: Callable[..., str]) -> str:
    """A real colocated server's /metrics after one streamed generation (the histograms have samples)."""
    url = start_server()
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": "coder", "max_tokens": 4, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Name three colours."}]}) as r:
        assert r.status_code == 200
        assert "[DONE]" in "".join(r.iter_text())
    return httpx.get(f"{url}/metrics", timeout=10).text


def router_exposition() -> str:
    """The router's own figures, over one prefill and one decode worker that moved KV once."""
    link = LinkFigures(bytes=1 << 20, seconds=0.01)
    members = [SimpleNamespace(url="http://p0", role="prefill", alive=True,
                               stats=WorkerStats(role="prefill", sent={"http://d0": link})),
               SimpleNamespace(url="http://d0", role="decode", alive=False,
                               stats=WorkerStats(role="decode", received={"tcp://p0": link},
                                                 imported_tokens={"raw": 64}))]
    router = SimpleNamespace(stats=RouterStats(retries=1, transfer_failures=1), members=members)
    router.stats.decisions["offloaded"] += 1
    registry = CollectorRegistry()
    registry.register(RouterCollector(router))
    return generate_latest(registry).decode()


def test_the_dashboard_is_a_grafana_dashboard_over_a_prometheus_variable(dashboard):
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["job"]["datasource"]["uid"] == DS
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = set()
    for p in panels(dashboard):
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p
        if p["type"] == "row":
            continue
        titles.add(p["title"])
        assert p["datasource"] == {"type": "prometheus", "uid": DS}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == DS and t["expr"].strip(), p["title"]
            assert 'job=~"$job"' in t["expr"], f"{p['title']!r} ignores the job variable: {t['expr']}"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    assert {"Sharing ratio", "Prefill tokens saved", "Time to first token", "Inter-token latency", "Queue time",
            "KV transfer bandwidth", "Route decisions by reason", "KV pool occupancy",
            "Requests running / waiting", "Rejected requests"} <= titles


def test_latency_panels_are_p50_p90_p99_of_one_minute_rates(dashboard):
    by_title = {p["title"]: p for p in panels(dashboard)}
    for title, metric in (("Time to first token", "agentshare_time_to_first_token_seconds"),
                          ("Inter-token latency", "agentshare_inter_token_latency_seconds"),
                          ("Queue time", "agentshare_request_queue_time_seconds")):
        exprs = [t["expr"] for t in by_title[title]["targets"]]
        assert [e.split(",")[0] for e in exprs] == [f"histogram_quantile({q}" for q in ("0.5", "0.9", "0.99")]
        assert all(f'rate({metric}_bucket{{job=~"$job"}}[1m])' in e and "by (le)" in e for e in exprs), exprs


def test_every_metric_the_dashboard_reads_is_exposed(dashboard, server_exposition):
    server = exposed_series(server_exposition)
    assert any(n == "agentshare_time_to_first_token_seconds_bucket" for n in server)
    assert re.search(r'^agentshare_time_to_first_token_seconds_count\{agent="coder"\} 1\.0$', server_exposition,
                     re.M), "the generation was observed"
    series = server | exposed_series(router_exposition())
    exprs = expressions(dashboard)
    used = set().union(*map(metric_names, exprs))
    assert len(used) >= 20 and all(n.startswith("agentshare_") for n in used), sorted(used)
    assert unknown_metrics(exprs, series) == []
    router_only = {"agentshare_route_decisions_total", "agentshare_kv_transfer_bytes_total",
                   "agentshare_kv_transfer_seconds_total", "agentshare_workers"}
    assert router_only <= used and not router_only & server.keys()


def test_a_misspelled_or_missuffixed_metric_is_caught(server_exposition):
    series = exposed_series(server_exposition)
    bad = unknown_metrics(['histogram_quantile(0.9, sum by (le) (rate(agentshare_time_to_frist_token_seconds_bucket'
                           '{job=~"$job"}[1m])))', 'sum(rate(agentshare_prompt_tokens{job=~"$job"}[1m]))',
                           'agentshare_kv_occupancy_bucket'], series)
    assert [b.split()[0] for b in bad] == ["agentshare_time_to_frist_token_seconds_bucket",
                                           "agentshare_prompt_tokens", "agentshare_kv_occupancy_bucket"]
    assert "['agentshare_prompt_tokens_total']" in bad[1]


def test_the_scrape_config_and_readme_name_the_dashboard():
    text = PROMETHEUS_YML.read_text()
    assert "scrape_configs:" in text and "metrics_path: /metrics" in text and "127.0.0.1:8000" in text
    assert DASHBOARD.name in DASHBOARD.with_name("README.md").read_text()
