"""What each workload's sessions send, without a server: a recording ``send`` answers them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from server.bench.client import RequestResult
from server.bench.load import arrivals
from server.bench.text import Corpus
from server.bench.workloads import Call, Reflexion, Trace, make_workload, parse_range


def play(session, *, fail_at: int | None = None) -> tuple[list[list[Call]], bool]:
    """Every batch of calls the session sends (answered "answer-<n>"), and its verdict."""
    batches: list[list[Call]] = []

    async def send(calls: Sequence[Call]) -> list[RequestResult]:
        batches.append(list(calls))
        out = []
        for c in calls:
            r = RequestResult(session.index, c.agent, c.step, 0.0, c.max_tokens, text=f"answer-{len(batches)}")
            out.append(r.fail("http_429", "scripted") if fail_at == len(batches) else r)
        return out

    ok = asyncio.run(session.run(send))
    return batches, ok


def test_react_asks_the_agents_together_over_a_growing_shared_context(corpus: Corpus) -> None:
    work = make_workload("react", corpus, ["a", "b", "c"], steps=3, context=(100, 100), think=(0, 0),
                         tool=(20, 20), output_tokens=7)
    batches, ok = play(work.session(5, seed=1))
    assert ok and [len(b) for b in batches] == [3, 3, 3]
    for step, batch in enumerate(batches):
        assert [c.agent for c in batch] == ["a", "b", "c"] and {c.step for c in batch} == {step}
        assert {c.max_tokens for c in batch} == {7}
        shared = [c.messages[:-1] for c in batch]
        assert shared[0] == shared[1] == shared[2]  # the same context and history: one prefill serves all
        assert len({c.messages[-1]["content"] for c in batch}) == 3  # each its own question
    assert batches[0][0].messages[:-1] == batches[1][0].messages[:1]  # the history grows, append-only
    assert "answer-1" in batches[1][0].messages[1]["content"] and "Tool result" in batches[1][0].messages[1]["content"]
    assert abs(corpus.count(batches[0][0].messages[0]["content"]) - 100) <= 20  # the drawn length, and a header


def test_a_session_is_its_seed_whatever_runs_before_it(corpus: Corpus) -> None:
    work = make_workload("react", corpus, ["a", "b"], steps=2, think=(0, 0))
    first, _ = play(work.session(3, seed=7))
    play(work.session(4, seed=7))
    again, _ = play(work.session(3, seed=7))
    other, _ = play(work.session(3, seed=8))
    assert first == again and first != other
    assert play(work.session(4, seed=7))[0][0][0].messages[0] != first[0][0].messages[0]  # sessions differ


def test_a_failed_request_ends_its_session(corpus: Corpus) -> None:
    work = make_workload("react", corpus, ["a"], steps=3, think=(0, 0))
    batches, ok = play(work.session(0, seed=0), fail_at=2)
    assert not ok and len(batches) == 2


def test_reflexion_plays_actor_evaluator_and_reflector_in_turn(corpus: Corpus) -> None:
    work = make_workload("reflexion", corpus, ["actor", "judge"], steps=2, think=(0, 0), context=(80, 80))
    assert isinstance(work, Reflexion) and work.roles() == ("actor", "judge", "actor")
    batches, ok = play(work.session(0, seed=0))
    assert ok and [len(b) for b in batches] == [1] * 6
    calls = [b[0] for b in batches]
    assert [c.agent for c in calls] == ["actor", "judge", "actor"] * 2 and [c.step for c in calls] == list(range(6))
    assert all(c.messages[0] == calls[0].messages[0] for c in calls)  # one task context throughout
    assert "answer-1" in calls[1].messages[-2]["content"]  # the evaluator reads the attempt
    assert "answer-3" in calls[3].messages[1]["content"]  # the next trial reads the reflection


def test_burst_is_one_step_of_every_agent(corpus: Corpus) -> None:
    batches, ok = play(make_workload("burst", corpus, ["a", "b", "c"], context=(300, 300)).session(0, seed=0))
    assert ok and len(batches) == 1 and len(batches[0]) == 3 and batches[0][0].max_tokens == 32


def write_trace(path: Path) -> Path:
    rows = [(0, 1536, 100, [1, 2, 3]), (500, 1024, 40, [1, 2]), (1000, 2048, 512, [1, 2, 3, 4]), (3000, 512, 1, [9])]
    path.write_text("\n".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h})
                              for t, i, o, h in rows) + "\n")
    return path


def test_trace_records_share_text_where_they_share_hash_ids(corpus: Corpus, tmp_path: Path) -> None:
    work = make_workload("trace:" + str(write_trace(tmp_path / "t.jsonl")), corpus, ["a", "b"], block_tokens=16)
    assert isinstance(work, Trace)
    calls = [play(work.session(i, seed=0))[0][0][0] for i in range(4)]
    assert [c.agent for c in calls] == ["a", "b", "a", "b"]  # record i to agent i mod K
    assert [c.max_tokens for c in calls] == [4, 2, 16, 1]  # output lengths scaled by 512 / 16
    assert calls[2].messages[0]["content"].startswith(calls[0].messages[0]["content"] + "\n")  # ids 1, 2 alike
    assert calls[1].messages[-1]["content"] == work.block(2) and len(calls[3].messages) == 1
    times = list(arrivals(work, rate=2.0, seed=0))
    assert times[0] == 0.0 and times[-1] == pytest.approx(2.0)  # 4 records at 2 per second: 3 s span scaled to 2
    assert times == sorted(times) and times[1] == pytest.approx(2.0 / 6)


def test_bad_workload_specs_say_what_is_wrong(corpus: Corpus, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("chat", corpus, ["a"])
    with pytest.raises(ValueError, match="at least one agent"):
        make_workload("react", corpus, [])
    with pytest.raises(ValueError, match="must divide"):
        make_workload("trace:" + str(write_trace(tmp_path / "t.jsonl")), corpus, ["a"], block_tokens=24)
    with pytest.raises(FileNotFoundError, match="trace not found"):
        make_workload("trace:" + str(tmp_path / "none.jsonl"), corpus, ["a"])
    with pytest.raises(ValueError, match="LOW-HIGH"):
        parse_range("5-", "--context")
    with pytest.raises(ValueError, match="LOW <= HIGH"):
        parse_range("9-3", "--think")
