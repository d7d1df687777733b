"""Results display: plain table, Jupyter HTML (escaped), rich; metrics parsing (no server)."""

from __future__ import annotations

import pytest

from agentshare import Answer, ForkResult, ServerMetrics, Timings, Usage


def answer(agent: str, text: str) -> Answer:
    return Answer(agent=agent, module="base", text=text, finish_reason="stop",
                  usage=Usage(prompt_tokens=100, cached_tokens=96, computed_tokens=4, completion_tokens=3),
                  timings=Timings(ttft=None, total=0.25))


def test_fork_result_displays() -> None:
    r = ForkResult((answer("a", "x <b>y</b>"), answer("b", "multi\nline " * 20)), wall=0.3, context_tokens=98)
    assert r["b"] is r[1] and r.texts["a"] == "x <b>y</b>" and r.cached_tokens == 192
    with pytest.raises(KeyError):
        r["c"]
    table = r.table(width=20)
    assert "2 agents on one shared context of 98 tokens" in table
    assert all(len(line.split("  ")[-1]) <= 20 for line in table.splitlines()[1:3])  # answers cut
    html = r._repr_html_()
    assert "&lt;b&gt;y&lt;/b&gt;" in html and "<b>y" not in html  # answers are escaped
    rich = pytest.importorskip("rich.console")
    console = rich.Console(record=True, width=140)
    console.print(r)
    text = console.export_text()
    assert "cached" in text and "wall time" in text


def test_metrics_delta_ignores_unknown_lines() -> None:
    m = ServerMetrics.parse("garbage line\nagentshare_prefill_tokens_total{source=\"cached\"} 5e2\n")
    assert m.prefill_cached_tokens == 500 and m.prefill_computed_tokens == 0
