"""The openai package, sync and async, against the real server: every response and chunk
validates against the package's own types."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

MESSAGES = [
    {"role": "user", "content": "Here is the task and its files. " + "def f(x): return x * 2. " * 12},
    {"role": "user", "content": "Summarise the task."},
]
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient(server_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


def chat_raw(client: openai.OpenAI, **kw: object) -> ChatCompletion:
    raw = client.chat.completions.with_raw_response.create(**kw)  # type: ignore[call-overload]
    return ChatCompletion.model_validate(json.loads(raw.text), strict=False)


def stream_chunks(server_url: str, path: str, body: dict[str, object]) -> list[dict[str, object]]:
    """Raw SSE data lines of a streamed request (ends with [DONE])."""
    out: list[dict[str, object]] = []
    with httpx.stream("POST", server_url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        out.append(json.loads(line.removeprefix("data: ")))
    return out


def completion_chunk(data: dict[str, object]) -> Completion:
    """Validate a streamed completion chunk as ``Completion``. The package's type requires a
    non-null ``finish_reason``, yet OpenAI's own API streams ``null`` before the last chunk (the
    client builds chunks without validating); so that one field is checked apart."""
    choices = []
    for c in data["choices"]:  # type: ignore[union-attr]
        assert c["finish_reason"] in (None, "stop", "length")
        choices.append({**c, "finish_reason": c["finish_reason"] or "length"})
    parsed = Completion.model_validate({**data, "choices": choices})
    for choice, c in zip(parsed.choices, data["choices"], strict=True):  # type: ignore[arg-type]
        choice.finish_reason = c["finish_reason"]
    return parsed


def test_models_lists_one_entry_per_agent(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert sorted(m.id for m in models.data) == ["base", "coder", "planner"]
    assert all(m.object == "model" for m in models.data)


def test_chat_completion_validates_and_usage_adds_up(client: openai.OpenAI) -> None:
    res = chat_raw(client, model="coder", messages=MESSAGES, **GREEDY)
    assert res.object == "chat.completion" and res.model == "coder" and len(res.choices) == 1
    choice = res.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    u = res.usage
    assert u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 1 <= u.completion_tokens <= 8
    assert u.prompt_tokens_details is not None and 0 <= u.prompt_tokens_details.cached_tokens <= u.prompt_tokens


def test_length_finish_at_the_limit(client: openai.OpenAI) -> None:
    res = chat_raw(client, model="base", messages=MESSAGES, temperature=0, max_completion_tokens=5,
                   extra_body={"ignore_eos": True})
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == 5


def test_extra_fields_are_tolerated(client: openai.OpenAI) -> None:
    res = chat_raw(client, model="base", messages=MESSAGES, **GREEDY, metadata={"run": "1"}, store=False,
                   extra_body={"some_future_field": {"x": 1}, "min_p": 0})
    assert res.choices[0].message.content is not None


# ---- penalties: OpenAI's frequency/presence, vLLM's repetition_penalty ------------------------

# The tiny random model hardly ever repeats a token by itself, so a penalty against repeats changes
# nothing there; a negative one (a reward; below 1 for repetition_penalty) makes it repeat. On this
# prompt an earlier token comes within 1.01 of the greedy one at the 6th step.
REPEAT = [{"role": "user", "content": "a a a a a a a a"}]


def greedy_text(client: openai.OpenAI, **kw: object) -> str:
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}  # type: ignore[dict-item]
    res = chat_raw(client, model="base", messages=REPEAT, temperature=0, max_tokens=16, extra_body=extra, **kw)
    return str(res.choices[0].message.content)


@pytest.mark.parametrize("penalty", [{"frequency_penalty": -2.0}, {"presence_penalty": -2.0},
                                     {"extra_body": {"repetition_penalty": 0.05}}])
def test_a_strong_penalty_is_accepted_and_changes_greedy_output(client: openai.OpenAI, penalty: dict) -> None:
    plain = greedy_text(client)
    penalized = greedy_text(client, **penalty)
    assert penalized != plain
    assert greedy_text(client, **penalty) == penalized  # still greedy: it repeats
    neutral = {k: ({"repetition_penalty": 1.0} if k == "extra_body" else 0.0) for k in penalty}
    assert greedy_text(client, **neutral) == plain


def test_frequency_and_presence_penalties_follow_their_formula_and_logprobs_stay_raw(client: openai.OpenAI) -> None:
    """Each greedy token is the argmax of ``logprob - f * count - p * (count > 0)`` (over the tokens
    generated before it) among the 20 most likely, while the logprobs reported are the model's
    own: the first token's equal those of an unpenalized request."""
    kw = {"model": "base", "messages": REPEAT, "temperature": 0, "max_tokens": 16, "logprobs": True,
          "top_logprobs": 20, "extra_body": {"ignore_eos": True}}
    plain = chat_raw(client, **kw).choices[0].logprobs.content  # type: ignore[union-attr]
    f, p = -0.5, -0.6  # rewards: the tiny model repeats nothing by itself
    steps = chat_raw(client, frequency_penalty=f, presence_penalty=p, **kw).choices[0].logprobs.content  # type: ignore[union-attr]
    # the same tokens and logprobs; equal up to float rounding, since the second request reads the
    # first one's cached prompt blocks and computes only the rest (another summation order)
    assert [t.token for t in steps[0].top_logprobs] == [t.token for t in plain[0].top_logprobs]
    assert [t.logprob for t in steps[0].top_logprobs] == pytest.approx([t.logprob for t in plain[0].top_logprobs], abs=1e-4)
    counts: dict[str, int] = {}
    moved = 0
    for step in steps:  # type: ignore[union-attr]
        def score(token: str, logprob: float) -> float:
            n = counts.get(token, 0)
            return logprob - f * n - p * (n > 0)
        best = max(score(t.token, t.logprob) for t in step.top_logprobs)
        assert score(step.token, step.logprob) == pytest.approx(best, abs=1e-4), step.token
        moved += step.token != step.top_logprobs[0].token
        counts[step.token] = counts.get(step.token, 0) + 1
    assert moved > 0  # the penalty did move some choice off the raw argmax


def test_penalties_on_completions_and_the_native_api(client: openai.OpenAI, server_url: str) -> None:
    def completion(**kw: object) -> str:
        res = client.completions.create(model="base", prompt="a a a a a a a a", temperature=0, max_tokens=32,
                                        **kw)  # type: ignore[call-overload]
        return str(res.choices[0].text)

    assert completion(presence_penalty=-2.0, extra_body={"ignore_eos": True}) != completion(
        extra_body={"ignore_eos": True})
    with httpx.Client(base_url=server_url, timeout=60) as http:
        ctx = http.post("/v1/contexts", json={"text": "A shared text about zones and replicas."}).json()["id"]

        def generate(**kw: object) -> list[int]:
            r = http.post(f"/v1/contexts/{ctx}/generate", json={"agent": "coder", "text": "a a a a a a a a",
                                                                "temperature": 0, "max_tokens": 32, "ignore_eos": True,
                                                                **kw})
            assert r.status_code == 200, r.text
            return list(r.json()["token_ids"])

        plain = generate()
        for penalty in ({"repetition_penalty": 0.05}, {"frequency_penalty": -2.0}, {"presence_penalty": -2.0}):
            assert generate(**penalty) != plain, penalty


def test_n_choices_have_their_indices(client: openai.OpenAI) -> None:
    res = chat_raw(client, model="planner", messages=MESSAGES, n=3, temperature=1.0, seed=7, max_tokens=4)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert 3 <= res.usage.completion_tokens <= 12  # summed over the choices; the prompt counts once
    assert res.usage.prompt_tokens == chat_raw(client, model="planner", messages=MESSAGES, max_tokens=1).usage.prompt_tokens


def test_seeded_choices_differ_and_choice_i_is_the_request_with_seed_plus_i(client: openai.OpenAI) -> None:
    kw = {"model": "planner", "messages": MESSAGES, "temperature": 1.0, "max_tokens": 6,
          "extra_body": {"ignore_eos": True}}
    texts = [c.message.content for c in chat_raw(client, n=3, seed=7, **kw).choices]
    assert len(set(texts)) == 3, texts
    assert texts == [chat_raw(client, seed=7 + i, **kw).choices[0].message.content for i in range(3)]


def test_sampled_logprobs_are_the_models_distribution_at_any_temperature(client: openai.OpenAI) -> None:
    # The first token's distribution depends on the prompt only: a request sampled at
    # temperature 1.8 reports the same top_logprobs as a greedy one (raw log-softmax).
    kw = {"model": "base", "messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 5}
    greedy = chat_raw(client, temperature=0, **kw).choices[0].logprobs.content[0]  # type: ignore[union-attr]
    top = {t.token: t.logprob for t in greedy.top_logprobs}
    for seed in (1, 2, 3):
        hot = chat_raw(client, temperature=1.8, seed=seed, **kw).choices[0].logprobs.content[0]  # type: ignore[union-attr]
        assert [t.token for t in hot.top_logprobs] == list(top)
        assert [t.logprob for t in hot.top_logprobs] == pytest.approx(list(top.values()), abs=1e-3)
        if hot.token in top:
            assert hot.logprob == pytest.approx(top[hot.token], abs=1e-3)
        assert hot.logprob <= greedy.top_logprobs[0].logprob + 1e-3


def test_seed_repeats(client: openai.OpenAI) -> None:
    a = chat_raw(client, model="base", messages=MESSAGES, temperature=1.0, seed=42, max_tokens=6)
    b = chat_raw(client, model="base", messages=MESSAGES, temperature=1.0, seed=42, max_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stop_sequence_cuts_the_text(client: openai.OpenAI) -> None:
    full = chat_raw(client, model="base", messages=MESSAGES, temperature=0, max_tokens=12,
                    extra_body={"ignore_eos": True}).choices[0].message.content
    assert full and len(full) >= 4
    stop = full[2:4]
    res = chat_raw(client, model="base", messages=MESSAGES, temperature=0, max_tokens=12, stop=[stop],
                   extra_body={"ignore_eos": True})
    assert res.choices[0].finish_reason == "stop"
    assert res.choices[0].message.content == full[: full.find(stop)]


def test_streamed_chat_equals_plain_and_ends_once_per_choice(client: openai.OpenAI, server_url: str) -> None:
    body = {"model": "coder", "messages": MESSAGES, "temperature": 0, "max_tokens": 10, "n": 2,
                "stream": True, "stream_options": {"include_usage": True}}
    chunks = stream_chunks(server_url, "/v1/chat/completions", body)
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    *content, last = parsed
    assert last.choices == [] and last.usage is not None
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, list[int]] = {0: [], 1: []}
    for i, ch in enumerate(content):
        assert ch.usage is None and len(ch.choices) == 1
        c = ch.choices[0]
        assert c.delta.content or c.finish_reason  # never an empty chunk, never before a token
        texts[c.index] += c.delta.content or ""
        if c.finish_reason:
            finishes[c.index].append(i)
    for index in (0, 1):
        assert len(finishes[index]) == 1  # exactly one finish_reason ...
        assert finishes[index][0] == max(i for i, ch in enumerate(content) if ch.choices[0].index == index)  # ... last
    first_of = {ch.choices[0].index: ch.choices[0].delta.role for ch in reversed(content)}
    assert first_of == {0: "assistant", 1: "assistant"}
    plain = chat_raw(client, model="coder", messages=MESSAGES, temperature=0, max_tokens=10)
    assert texts[0] == texts[1] == plain.choices[0].message.content
    assert last.usage.completion_tokens == 2 * plain.usage.completion_tokens


def test_sync_client_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="base", messages=MESSAGES, temperature=0, max_tokens=6,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_raw(client, model="base", messages=MESSAGES, temperature=0, max_tokens=6).choices[0].message.content


def test_async_client_chat_and_stream(aclient: openai.AsyncOpenAI) -> None:
    async def main() -> tuple[str, str, int]:
        plain = await aclient.chat.completions.create(model="planner", messages=MESSAGES, **GREEDY)
        stream = await aclient.chat.completions.create(model="planner", messages=MESSAGES, stream=True,
                                                       stream_options={"include_usage": True}, **GREEDY)
        text, usage = "", None
        async for chunk in stream:
            ChatCompletionChunk.model_validate(chunk.model_dump())
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert usage is not None
        return plain.choices[0].message.content or "", text, usage.completion_tokens

    plain, streamed, completion = asyncio.run(main())
    assert plain == streamed and completion >= 1


def test_chat_logprobs(client: openai.OpenAI) -> None:
    res = chat_raw(client, model="base", messages=MESSAGES, temperature=0, max_tokens=4, logprobs=True,
                   top_logprobs=2)
    content = res.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == res.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-5 for t in content)  # greedy: the top token


def test_completions_plain_streamed_and_batched(client: openai.OpenAI, server_url: str) -> None:
    prompt = "The files of the task: " + "a = 1; b = 2; " * 10
    raw = client.completions.with_raw_response.create(model="coder", prompt=prompt, temperature=0, max_tokens=6,
                                                      logprobs=1)
    res = Completion.model_validate(json.loads(raw.text))
    assert res.object == "text_completion" and res.usage is not None
    assert res.choices[0].logprobs is not None and len(res.choices[0].logprobs.tokens or []) == res.usage.completion_tokens
    chunks = [completion_chunk(c) for c in stream_chunks(
        server_url, "/v1/completions",
        {"model": "coder", "prompt": prompt, "temperature": 0, "max_tokens": 6, "stream": True,
             "stream_options": {"include_usage": True}})]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == res.choices[0].text
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == res.usage.completion_tokens
    batch = client.completions.create(model="base", prompt=[prompt, "Other text"], n=2, temperature=0, max_tokens=3)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text
