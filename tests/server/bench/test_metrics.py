"""The figures `agentshare bench` reports: exact on scripted records, measured right against a
fake endpoint whose timings are known, and every failure counted."""

from __future__ import annotations

import asyncio
import math

import pytest

from server.bench import Load, Options, bench, make_workload
from server.bench.client import RequestResult
from server.bench.metrics import SessionResult, parse_slo, summarize, sustained
from server.bench.report import capacity, table
from server.bench.text import Corpus
from tests.server.bench.conftest import CACHED_TOKENS, ITL_S, PROMPT_TOKENS, TOKENS, TTFT_S


def request(session: int, sent: float, ttft: float, itl: float, tokens: int, *, cached: int | None = 10,
            failure: str | None = None, warmup: bool = False) -> RequestResult:
    r = RequestResult(session, "a", 0, sent, max_tokens=tokens, prompt_tokens=100, cached_tokens=cached,
                      completion_tokens=tokens, warmup=warmup)
    if failure:
        return r.fail(failure, "scripted")
    r.first = sent + ttft
    r.itl = [itl] * (tokens - 1)
    r.done = r.first + itl * (tokens - 1)
    return r


def test_summarize_on_scripted_records_is_exact() -> None:
    # two sessions of two requests; one warm-up request and session, left out; one 429
    reqs = [request(0, 0.0, 1.0, 0.5, 3), request(0, 2.0, 2.0, 0.25, 5),
            request(1, 1.0, 3.0, 0.5, 3, cached=None), request(1, 4.0, 0.5, 0.5, 1),
            request(2, 5.0, 0, 0, 4, failure="http_429"), request(9, -5.0, 9.0, 9.0, 3, warmup=True)]
    sessions = [SessionResult(0, 0.0, 6.0, True), SessionResult(1, 1.0, 4.5, True), SessionResult(2, 5.0, 5.0, False),
                SessionResult(9, -5.0, -1.0, True, warmup=True)]
    s = summarize(reqs, sessions, t0=0.0, last_arrival=5.0, slo={"ttft": 2000}, offered_rate=0.5)
    assert (s["requests"], s["completed"], s["failed"], s["failures"]) == (5, 4, 1, {"http_429": 1})
    assert (s["sessions"], s["sessions_completed"]) == (3, 2)
    assert s["duration_s"] == 6.0  # t0 to the last completion (request 2 ends at 2 + 2 + 4*0.25 = 5; session 0 at 6)
    assert s["request_throughput"] == 4 / 6 and s["output_throughput"] == 12 / 6
    assert s["total_token_throughput"] == (400 + 12) / 6
    assert s["mean_ttft_ms"] == pytest.approx(1625.0) and s["median_ttft_ms"] == pytest.approx(1500.0)
    # TPOT: (E2E - TTFT) / (n - 1) of the requests with >= 2 tokens: 0.5, 0.25, 0.5
    assert s["mean_tpot_ms"] == pytest.approx(1000 * 1.25 / 3)
    # ITL pools every gap: 2 x 0.5, 4 x 0.25, 2 x 0.5
    assert s["mean_itl_ms"] == pytest.approx(1000 * 3.0 / 8) and s["median_itl_ms"] == pytest.approx(375.0)
    assert s["mean_e2el_ms"] == pytest.approx(1000 * (2.0 + 3.0 + 4.0 + 0.5) / 4)
    assert s["mean_session_s"] == pytest.approx((6.0 + 3.5) / 2)
    assert s["cache_hit_ratio"] == pytest.approx(30 / 300)  # the three that reported cached tokens
    # goodput: TTFT <= 2 s met by requests 0, 1 and 3; session 0 met it throughout, session 1 did not
    assert s["request_goodput"] == pytest.approx(3 / 6) and s["session_goodput"] == pytest.approx(1 / 6)
    assert s["short_answers"] == 0


def test_steadiness_and_the_capacity_rule() -> None:
    base = {"offered_session_rate": 1.0, "arrival_rate": 1.1, "failed": 0, "achieved_session_rate": 1.05,
            "half_sizes": [20, 20],
            "p95_ttft_first_half_ms": 100.0, "p95_ttft_second_half_ms": 120.0}
    assert sustained(base)[0]
    assert not sustained(base | {"failed": 1})[0]
    assert "achieved" in sustained(base | {"achieved_session_rate": 1.04})[1]  # below 95 % of 1.1 arriving
    assert "run longer" in sustained(base | {"achieved_session_rate": None})[1]
    assert sustained(base | {"p95_ttft_second_half_ms": 1099.0})[0]  # 11x, but by less than a second
    grown = {"p95_ttft_first_half_ms": 2000.0, "p95_ttft_second_half_ms": 3100.0}
    assert "grew" in sustained(base | grown)[1]  # 1.55x and 1.1 s
    assert sustained(base | grown | {"p95_ttft_second_half_ms": 2400.0})[0]  # 1.2x
    assert "too few" in sustained(base | {"half_sizes": [9, 30]})[1]
    assert "closed loop" in sustained(base | {"offered_session_rate": None})[1]
    runs = [{"load": {"session_rate": r}, "sustained": [ok, ""]} for r, ok in ((0.5, True), (1.0, True), (2.0, False),
                                                                             (4.0, True))]
    assert capacity(runs) == 1.0  # 4.0 held by luck after 2.0 failed: capacity stops at the first failure
    assert capacity([]) is None and capacity(runs[2:3]) is None


def test_achieved_rate_is_the_completions_against_the_arrivals() -> None:
    # sessions arrive each second from 0 to 9 and take 2 or 2.5 s each: the server kept up
    reqs = [request(i, float(i), 0.5, 0.5, 4) for i in range(10)]
    kept_up = [SessionResult(i, float(i), i + 2.0 + 0.5 * (i % 3 == 1), True) for i in range(10)]
    s = summarize(reqs, kept_up, t0=0.0, last_arrival=9.0, offered_rate=1.2)
    assert s["arrival_rate"] == pytest.approx(1.0) and s["achieved_session_rate"] == pytest.approx(1.0, abs=0.03)
    assert s["half_sizes"] == [5, 5] and s["offered_session_rate"] == 1.2
    # the same arrivals served one every 2 s behind a queue: half the rate
    behind = [SessionResult(i, float(i), 2.0 + 2.0 * i, True) for i in range(10)]
    s = summarize(reqs, behind, t0=0.0, last_arrival=9.0, offered_rate=1.0)
    assert s["achieved_session_rate"] == pytest.approx(0.5)
    assert s["completion_slope"] == pytest.approx(2.0)
    # one session ten times as long as the others barely moves the estimate
    slow_last = [*kept_up[:9], SessionResult(9, 9.0, 9.0 + 20.0, True)]
    s = summarize(reqs, slow_last, t0=0.0, last_arrival=9.0, offered_rate=1.0)
    assert 0.95 < s["achieved_session_rate"] <= 1.0
    s = summarize(reqs[:2], kept_up[:2], t0=0.0, last_arrival=1.0, offered_rate=1.0)
    assert s["arrival_rate"] == 1.0 and s["achieved_session_rate"] is None  # two sessions tell no slope


def test_slo_parsing_says_what_is_wrong() -> None:
    assert parse_slo(None) == {} and parse_slo("e2el:900, ttft:50") == {"e2el": 900.0, "ttft": 50.0}
    for bad, says in (("latency:3", "one of ttft"), ("ttft:fast", "milliseconds"), ("tpot:0", "positive")):
        with pytest.raises(ValueError, match=says):
            parse_slo(bad)


def test_timings_against_a_fake_endpoint_whose_timings_are_known(fake_url: str, corpus: Corpus) -> None:
    work = make_workload("burst", corpus, ["steady"] * 3, context=(40, 60), output_tokens=TOKENS)
    result = asyncio.run(bench(fake_url, work, [Load(rate=4.0)], Options(duration_s=1.0, warmup=1, progress=False)))
    s = result["runs"][0]["summary"]
    assert s["failed"] == 0 and s["completed"] == 3 * s["sessions"] >= 3
    slack = 0.25  # a busy 2-core host's scheduling, in seconds
    assert TTFT_S * 1e3 <= s["median_ttft_ms"] <= (TTFT_S + slack) * 1e3
    assert ITL_S * 1e3 * 0.95 <= s["median_itl_ms"] <= (ITL_S + slack) * 1e3
    assert ITL_S * 1e3 * 0.95 <= s["median_tpot_ms"] <= (ITL_S + slack) * 1e3
    assert s["median_e2el_ms"] >= (TTFT_S + ITL_S * (TOKENS - 1)) * 1e3
    assert s["cache_hit_ratio"] == CACHED_TOKENS / PROMPT_TOKENS and s["completion_tokens"] == TOKENS * s["completed"]
    assert s["prompt_tokens"] == PROMPT_TOKENS * s["completed"]
    assert result["runs"][0]["server"]["gauges"] == {"vllm:num_requests_waiting": {"mean": 1.0, "max": 1.0}}
    assert "rate 4/s" in table(result)


def test_every_failure_is_counted_with_its_kind(fake_url: str, corpus: Corpus) -> None:
    work = make_workload("burst", corpus, ["steady", "busy", "slow", "broken"], context=(40, 60),
                         output_tokens=TOKENS)
    result = asyncio.run(bench(fake_url, work, [Load(concurrency=1)],
                               Options(duration_s=0.1, max_sessions=1, warmup=0, request_timeout_s=1.0,
                                       progress=False)))
    s = result["runs"][0]["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (4, 1, 3)
    assert s["failures"] == {"http_429": 1, "timeout": 1, "stream": 1}
    assert s["sessions_completed"] == 0  # a session with a failed request did not complete
    assert any("queue full" in e for e in s["errors"]) and any("engine stopped" in e for e in s["errors"])
    assert "failed:" in table(result)
    assert not math.isnan(s["median_ttft_ms"])  # the one that answered is measured


def test_bench_refuses_what_the_endpoint_does_not_serve(fake_url: str, corpus: Corpus) -> None:
    work = make_workload("burst", corpus, ["steady", "nope"])
    with pytest.raises(RuntimeError, match="does not serve nope"):
        asyncio.run(bench(fake_url, work, [Load(concurrency=1)], Options(progress=False)))
    with pytest.raises(RuntimeError, match="cannot reach"):
        asyncio.run(bench("http://127.0.0.1:9", work, [Load(concurrency=1)], Options(progress=False)))
