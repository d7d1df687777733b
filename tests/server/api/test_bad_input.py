"""Bad input against the real server: every case gets a 4xx in OpenAI's error shape whose
``error.param`` is the field at fault, the server keeps serving after each one, and nothing
gets a 5xx. Valid extremes (a top_p of 1e-300, the largest seed) are served, promptly.

Then property-based fuzzing of the request schemas (hypothesis, a bounded number of examples):
never a 5xx, always OpenAI's error shape for a 4xx. Then the per-tenant quota on pinned contexts.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentshare.protocol import MAX_N, MAX_STOP, MAX_STOP_CHARS, MAX_TOP_K, MAX_TOP_LOGPROBS

CHAT_URL, COMPLETION_URL = "/v1/chat/completions", "/v1/completions"
CHAT: dict[str, Any] = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION: dict[str, Any] = {"model": "base", "prompt": "hi", "max_tokens": 1}
MB = "x" * (1 << 20)
LONG = "word " * 5000  # more tokens than the tiny model's 4096-token context
SURROGATE = "ok \ud800 ok"  # a lone surrogate: JSON can carry it (\\ud800), no tokenizer can encode it
TIMEOUT = 30.0  # no answer by then counts as a hang


def user(content: object) -> list[dict[str, object]]:
    return [{"role": "user", "content": content}]


def chat(**fields: object) -> dict[str, Any]:
    return {**CHAT, **fields}


def completion(**fields: object) -> dict[str, Any]:
    return {**COMPLETION, **fields}


def without(body: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != name}


# (case id, path, JSON body or raw bytes, status, error.param); "{ctx}" is a live text context's id
CASES: list[tuple[str, str, object, int, str | None]] = [
    # the body cannot be read
    ("malformed JSON", CHAT_URL, b'{"model": "base", "messages": [', 400, None),
    ("empty body", CHAT_URL, b"", 400, None),
    ("JSON array body", CHAT_URL, b"[1, 2]", 400, None),
    ("invalid UTF-8 bytes", CHAT_URL, b'{"model": "base", "messages": [{"role": "user", "content": "\xff"}]}',
     400, None),
    ("integer of 5000 digits", CHAT_URL, b'{"model": "base", "messages": [], "seed": ' + b"9" * 5000 + b"}",
     400, None),
    # wrong types
    ("messages a string", CHAT_URL, chat(messages="hi"), 400, "messages"),
    ("model missing", CHAT_URL, without(CHAT, "model"), 400, "model"),
    ("model a number", CHAT_URL, chat(model=5), 400, "model"),
    ("messages missing", CHAT_URL, without(CHAT, "messages"), 400, "messages"),
    ("message a number", CHAT_URL, chat(messages=[5]), 400, "messages"),
    ("content a number", CHAT_URL, chat(messages=user(5)), 400, "messages"),
    ("max_tokens a word", CHAT_URL, chat(max_tokens="many"), 400, "max_tokens"),
    ("temperature a word", CHAT_URL, chat(temperature="hot"), 400, "temperature"),
    ("top_p a list", CHAT_URL, chat(top_p=[]), 400, "top_p"),
    ("n a fraction", CHAT_URL, chat(n=1.5), 422, "n"),
    ("seed a word", CHAT_URL, chat(seed="abc"), 400, "seed"),
    ("seed a fraction", CHAT_URL, chat(seed=1.5), 422, "seed"),
    ("stream a word", CHAT_URL, chat(stream="maybe"), 400, "stream"),
    ("stop a number", CHAT_URL, chat(stop=5), 400, "stop"),
    ("logprobs a word", CHAT_URL, chat(logprobs="x"), 400, "logprobs"),
    ("stream_options a word", CHAT_URL, chat(stream=True, stream_options="x"), 400, "stream_options"),
    ("prompt missing", COMPLETION_URL, without(COMPLETION, "prompt"), 400, "prompt"),
    ("prompt a number", COMPLETION_URL, completion(prompt=5), 400, "prompt"),
    ("prompt mixes text and ids", COMPLETION_URL, completion(prompt=["a", [1]]), 400, "prompt"),
    ("ttl a word", "/v1/contexts", {"text": "x", "ttl": "long"}, 400, "ttl"),
    ("agent missing", "/v1/contexts/{ctx}/generate", {"text": "x"}, 400, "agent"),
    # out-of-range values
    ("max_tokens 0", CHAT_URL, chat(max_tokens=0), 422, "max_tokens"),
    ("max_tokens -1", CHAT_URL, chat(max_tokens=-1), 422, "max_tokens"),
    ("max_completion_tokens 0", CHAT_URL, chat(max_completion_tokens=0), 422, "max_completion_tokens"),
    ("temperature -0.5", CHAT_URL, chat(temperature=-0.5), 422, "temperature"),
    ("temperature 2.5", CHAT_URL, chat(temperature=2.5), 422, "temperature"),
    ("temperature NaN", CHAT_URL, chat(temperature=float("nan")), 422, "temperature"),
    ("temperature Infinity", CHAT_URL, chat(temperature=float("inf")), 422, "temperature"),
    ("top_p 0", CHAT_URL, chat(top_p=0), 422, "top_p"),
    ("top_p -0.1", CHAT_URL, chat(top_p=-0.1), 422, "top_p"),
    ("top_p 1.5", CHAT_URL, chat(top_p=1.5), 422, "top_p"),
    ("top_p NaN", CHAT_URL, chat(top_p=float("nan")), 422, "top_p"),
    ("top_k -2", CHAT_URL, chat(top_k=-2), 422, "top_k"),
    ("top_k 2**31", CHAT_URL, chat(top_k=MAX_TOP_K + 1), 422, "top_k"),
    ("seed -1", CHAT_URL, chat(seed=-1), 422, "seed"),
    ("seed 2**64", CHAT_URL, chat(seed=2**64), 422, "seed"),
    ("seed 2**80", CHAT_URL, chat(seed=2**80), 422, "seed"),
    ("seed 2**64-1 with n=2", CHAT_URL, chat(seed=2**64 - 1, n=2), 422, "seed"),
    ("completion seed 2**64", COMPLETION_URL, completion(seed=2**64), 422, "seed"),
    ("completion seed 2**64-1 with n=2", COMPLETION_URL, completion(seed=2**64 - 1, n=2), 422, "seed"),
    ("n 0", CHAT_URL, chat(n=0), 422, "n"),
    (f"n {MAX_N + 1}", CHAT_URL, chat(n=MAX_N + 1), 422, "n"),
    (f"top_logprobs {MAX_TOP_LOGPROBS + 1}", CHAT_URL, chat(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS + 1),
     422, "top_logprobs"),
    ("top_logprobs -1", CHAT_URL, chat(logprobs=True, top_logprobs=-1), 422, "top_logprobs"),
    (f"completion logprobs {MAX_TOP_LOGPROBS + 1}", COMPLETION_URL, completion(logprobs=MAX_TOP_LOGPROBS + 1),
     422, "logprobs"),
    (f"{MAX_STOP + 1} stops", CHAT_URL, chat(stop=[f"s{i}" for i in range(MAX_STOP + 1)]), 422, "stop"),
    ("an empty stop", CHAT_URL, chat(stop=[""]), 422, "stop"),
    (f"a stop of {MAX_STOP_CHARS + 1} characters", CHAT_URL, chat(stop="y" * (MAX_STOP_CHARS + 1)), 422, "stop"),
    ("no messages", CHAT_URL, chat(messages=[]), 422, "messages"),
    ("unknown role", CHAT_URL, chat(messages=[{"role": "wizard", "content": "x"}]), 422, "messages"),
    ("user message without content", CHAT_URL, chat(messages=[{"role": "user"}]), 422, "messages"),
    ("ttl -5", "/v1/contexts", {"text": "x", "ttl": -5}, 422, "ttl"),
    ("ttl 10**9", "/v1/contexts", {"text": "x", "ttl": 10**9}, 422, "ttl"),
    ("context with neither messages nor text", "/v1/contexts", {}, 422, "messages"),
    ("context with both messages and text", "/v1/contexts", {"messages": user("x"), "text": "y"}, 422, "messages"),
    ("empty text context", "/v1/contexts", {"text": ""}, 422, "text"),
    ("generate seed 2**64", "/v1/contexts/{ctx}/generate", {"agent": "coder", "text": "x", "seed": 2**64},
     422, "seed"),
    ("generate top_p 0", "/v1/contexts/{ctx}/generate", {"agent": "coder", "text": "x", "top_p": 0}, 422, "top_p"),
    (f"generate logprobs {MAX_TOP_LOGPROBS + 1}", "/v1/contexts/{ctx}/generate",
     {"agent": "coder", "text": "x", "logprobs": MAX_TOP_LOGPROBS + 1}, 422, "logprobs"),
    ("messages for a text context", "/v1/contexts/{ctx}/generate", {"agent": "coder", "messages": user("x")},
     422, "messages"),
    ("explain with neither messages nor prompt", "/v1/explain", {"agent": "coder"}, 422, "messages"),
    # out-of-vocabulary token ids, empty prompts
    ("token id 10**9", COMPLETION_URL, completion(prompt=[1, 10**9]), 422, "prompt"),
    ("token id -1", COMPLETION_URL, completion(prompt=[-1]), 422, "prompt"),
    ("token id 2**80 in a batch", COMPLETION_URL, completion(prompt=[[1, 2], [2**80]]), 422, "prompt"),
    ("empty prompt list", COMPLETION_URL, completion(prompt=[]), 422, "prompt"),
    ("empty token-id prompt", COMPLETION_URL, completion(prompt=[[]]), 422, "prompt"),
    # refused OpenAI options
    ("logit_bias", CHAT_URL, chat(logit_bias={"1": 5}), 422, "logit_bias"),
    ("presence_penalty 2.5", CHAT_URL, chat(presence_penalty=2.5), 422, "presence_penalty"),
    ("frequency_penalty -3", COMPLETION_URL, completion(frequency_penalty=-3), 422, "frequency_penalty"),
    ("repetition_penalty 0", CHAT_URL, chat(repetition_penalty=0), 422, "repetition_penalty"),
    ("generate repetition_penalty -1", "/v1/contexts/{ctx}/generate",
     {"agent": "coder", "text": "x", "repetition_penalty": -1}, 422, "repetition_penalty"),
    # sampling knobs this server does not implement: refused (400), never silently ignored
    ("min_p", CHAT_URL, chat(min_p=0.05), 400, "min_p"),
    ("completion min_tokens", COMPLETION_URL, completion(min_tokens=3), 400, "min_tokens"),
    ("chat best_of 2", CHAT_URL, chat(best_of=2), 400, "best_of"),
    ("generate min_p", "/v1/contexts/{ctx}/generate", {"agent": "coder", "text": "x", "min_p": 0.1}, 400, "min_p"),
    ("generate logit_bias", "/v1/contexts/{ctx}/generate", {"agent": "coder", "text": "x", "logit_bias": {"1": 2}},
     400, "logit_bias"),
    ("tools", CHAT_URL, chat(tools=[{"type": "web", "function": {"name": "f"}}]), 422, "tools"),
    ("response_format", CHAT_URL, chat(response_format={"type": "xml"}), 422, "response_format"),
    ("suffix", COMPLETION_URL, completion(suffix="x"), 422, "suffix"),
    ("echo", COMPLETION_URL, completion(echo=True), 422, "echo"),
    ("best_of 2 with n=1", COMPLETION_URL, completion(best_of=2), 422, "best_of"),
    ("best_of 0", COMPLETION_URL, completion(best_of=0), 422, "best_of"),
    # lone surrogates (invalid Unicode)
    ("surrogate in chat content", CHAT_URL, chat(messages=user(SURROGATE)), 400, "messages"),
    ("surrogate in a context message", CHAT_URL,
     chat(messages=[{"role": "user", "content": SURROGATE}, {"role": "user", "content": "hi"}]), 400, "messages"),
    ("surrogate in a text part", CHAT_URL, chat(messages=user([{"type": "text", "text": SURROGATE}])), 400,
     "messages"),
    ("surrogate in a name", CHAT_URL, chat(messages=[{"role": "user", "content": "x", "name": SURROGATE}]), 400,
     "messages"),
    ("surrogate in model", CHAT_URL, chat(model=SURROGATE), 400, "model"),
    ("surrogate in stop", CHAT_URL, chat(stop=[SURROGATE]), 400, "stop"),
    ("surrogate in a completion prompt", COMPLETION_URL, completion(prompt=SURROGATE), 400, "prompt"),
    ("surrogate in a batched prompt", COMPLETION_URL, completion(prompt=["ok", SURROGATE]), 400, "prompt"),
    ("surrogate in a context's text", "/v1/contexts", {"text": SURROGATE}, 400, "text"),
    ("surrogate in a context's messages", "/v1/contexts", {"messages": user(SURROGATE)}, 400, "messages"),
    ("surrogate in a turn", "/v1/contexts/{ctx}/generate", {"agent": "coder", "text": SURROGATE}, 400, "text"),
    ("surrogate in an extension", "/v1/contexts/{ctx}/extend", {"text": SURROGATE}, 400, "text"),
    ("surrogate in an explained prompt", "/v1/explain", {"agent": "coder", "prompt": SURROGATE}, 400, "prompt"),
    # prompts over the context window, 1 MB strings
    ("chat over the context window", CHAT_URL, chat(messages=user(LONG)), 413, "messages"),
    ("1 MB chat message", CHAT_URL, chat(messages=user(MB)), 413, "messages"),
    ("completion over the context window", COMPLETION_URL, completion(prompt=LONG), 413, "prompt"),
    ("4097 token ids", COMPLETION_URL, completion(prompt=[1] * 4097), 413, "prompt"),
    ("1 MB completion prompt", COMPLETION_URL, completion(prompt=MB), 413, "prompt"),
    ("1 MB context", "/v1/contexts", {"text": MB}, 413, "text"),
    ("1 MB turn", "/v1/contexts/{ctx}/generate", {"agent": "coder", "text": MB}, 413, "text"),
    ("1 MB stop", CHAT_URL, chat(stop=MB), 422, "stop"),
    ("1 MB model name", CHAT_URL, chat(model=MB), 404, "model"),
    # unknown names
    ("unknown model", CHAT_URL, chat(model="nope"), 404, "model"),
    ("unknown agent", "/v1/contexts/{ctx}/generate", {"agent": "nope", "text": "x"}, 404, "agent"),
    ("unknown context", "/v1/contexts/ctx_missing/generate", {"agent": "coder", "text": "x"}, 404, "context_id"),
    ("unknown context extended", "/v1/contexts/ctx_missing/extend", {"text": "x"}, 404, "context_id"),
    ("context id of invalid UTF-8", "/v1/contexts/%ED%A0%80%FF/generate", {"agent": "coder", "text": "x"}, 404,
     "context_id"),
    ("unknown agent explained", "/v1/explain", {"agent": "nope", "prompt": "x"}, 404, "agent"),
    ("unknown route", "/v1/nothing-here", {}, 404, None),
]

# Valid extremes: served (200) within TIMEOUT
SERVED: list[tuple[str, str, dict[str, Any]]] = [
    ("top_p 1e-300", CHAT_URL, chat(temperature=1.0, top_p=1e-300, max_tokens=4)),
    ("temperature 1e-300", CHAT_URL, chat(temperature=1e-300, max_tokens=4)),
    ("top_k 2**31-1", CHAT_URL, chat(top_k=MAX_TOP_K, max_tokens=2)),
    ("seed 2**64-1", CHAT_URL, chat(seed=2**64 - 1, temperature=1.0, max_tokens=2)),
    ("seed 2**64-2 with n=2", COMPLETION_URL, completion(seed=2**64 - 2, n=2, temperature=1.0, max_tokens=2)),
    (f"n {MAX_N}", CHAT_URL, chat(n=MAX_N, max_tokens=1)),
    (f"top_logprobs {MAX_TOP_LOGPROBS}", CHAT_URL, chat(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS)),
    (f"completion logprobs {MAX_TOP_LOGPROBS}", COMPLETION_URL, completion(logprobs=MAX_TOP_LOGPROBS)),
    (f"{MAX_STOP} stops", CHAT_URL, chat(stop=[f"s{i}" for i in range(MAX_STOP)], max_tokens=2)),
    ("token ids at both ends of the vocabulary", COMPLETION_URL, completion(prompt=[0, 49151])),
    ("1 MB user field (ignored)", CHAT_URL, chat(user=MB)),
    ("unrelated extras (ignored)", CHAT_URL, chat(metadata={"a": "b"}, store=False, parallel_tool_calls=True,
                                                  some_future_field={"x": 1})),
    ("unsupported knobs at their neutral values", CHAT_URL, chat(min_p=0, typical_p=1.0, use_beam_search=False,
                                                                 best_of=1, min_tokens=0, length_penalty=1)),
    ("penalties at their limits", CHAT_URL, chat(presence_penalty=2, frequency_penalty=-2, repetition_penalty=1e-3,
                                                 max_tokens=3)),
    ("completion penalties", COMPLETION_URL, completion(presence_penalty=-2, frequency_penalty=2,
                                                        repetition_penalty=50.0, max_tokens=3)),
]


@pytest.fixture(scope="module")
def http(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def text_context(http: httpx.Client) -> str:
    r = http.post("/v1/contexts", json={"text": "A shared document about zones and replicas.", "ttl": 3600})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def send(http: httpx.Client, path: str, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a 4xx response (asserting its shape)."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["param"] is None or re.fullmatch(r"[a-z_]+", err["param"]), err
    return dict(err)


def assert_still_serving(http: httpx.Client) -> None:
    r = http.post(CHAT_URL, json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


@pytest.mark.parametrize(("path", "body", "status", "param"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_bad_input_gets_a_4xx_naming_the_field(http: httpx.Client, text_context: str, path: str, body: object,
                                               status: int, param: str | None) -> None:
    r = send(http, path.replace("{ctx}", text_context), body)
    assert r.status_code == status, r.text[:500]
    err = error_of(r)
    assert err["param"] == param, err
    assert len(err["message"]) < 2000, "messages quote a client's value only in part"
    assert_still_serving(http)


@pytest.mark.parametrize(("path", "body"), [pytest.param(*c[1:], id=c[0]) for c in SERVED])
def test_valid_extremes_are_served_promptly(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    start = time.monotonic()
    r = send(http, path, body)
    assert r.status_code == 200, r.text[:500]
    choices = r.json()["choices"]
    assert len(choices) == body.get("n", 1) and all(c["finish_reason"] in ("stop", "length") for c in choices)
    assert time.monotonic() - start < TIMEOUT
    assert_still_serving(http)


def test_a_seed_near_the_top_repeats(http: httpx.Client) -> None:
    """The largest seeds are real seeds: the same request gives the same tokens."""
    body = chat(seed=2**64 - 1, temperature=1.0, max_tokens=6, ignore_eos=True)
    texts = {send(http, CHAT_URL, body).json()["choices"][0]["message"]["content"] for _ in range(2)}
    assert len(texts) == 1


def test_streamed_bad_input_is_refused_before_the_stream(http: httpx.Client) -> None:
    """A streamed request with a bad value gets the same 4xx, not a stream that fails."""
    for body, param in ((chat(stream=True, seed=2**64), "seed"), (chat(stream=True, messages=user(LONG)), "messages"),
                        (completion(stream=True, prompt=SURROGATE), "prompt")):
        r = send(http, CHAT_URL if "messages" in body else COMPLETION_URL, body)
        assert r.headers["content-type"].startswith("application/json")
        assert error_of(r)["param"] == param


# ---- property-based fuzzing of the request schemas ------------------------------------------

JUNK_TEXT = st.sampled_from(["", "x", SURROGATE, "\x00", "é" * 3, "hello there", "y" * (MAX_STOP_CHARS + 1)])
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=8) | JUNK_TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=6)


@st.composite
def mostly(draw: st.DrawFn, good: st.SearchStrategy[Any], junk: st.SearchStrategy[Any] = JSON) -> Any:
    """A value of the field's own kind (in or out of range), and 1 time in 8 any JSON at all."""
    return draw(junk) if draw(st.integers(0, 7)) == 7 else draw(good)


TEXT = mostly(st.text(max_size=12), JUNK_TEXT)
SMALL = st.integers(-1, 3)  # token counts: never a long generation
MESSAGE = st.fixed_dictionaries({
    "role": mostly(st.sampled_from(["user", "system", "assistant", "developer"]), st.sampled_from(["tool", "x", ""])),
    "content": mostly(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)),
})
MESSAGES = mostly(st.lists(MESSAGE, min_size=1, max_size=3))
SAMPLING = {
    "max_tokens": mostly(SMALL), "temperature": mostly(st.floats(-0.5, 2.5)), "top_p": mostly(st.floats(-0.2, 1.2)),
    "top_k": mostly(st.integers(-2, 2**32)), "seed": mostly(st.integers(-2, 2**64 + 2)),
    "stop": mostly(TEXT | st.lists(TEXT, max_size=MAX_STOP + 1)), "ignore_eos": mostly(st.booleans()),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "presence_penalty": mostly(st.just(0) | st.floats(-2.5, 2.5)),
    "frequency_penalty": mostly(st.just(0) | st.floats(-2.5, 2.5)),
    "repetition_penalty": mostly(st.just(1) | st.floats(-0.5, 3)), "min_p": mostly(st.just(0) | st.floats(0, 1)),
}
OPENAI = {**SAMPLING, "model": mostly(st.sampled_from(["base", "coder", "planner"]), TEXT | JSON), "n": mostly(SMALL),
          "logit_bias": JSON, "user": TEXT}
CHAT_FIELDS = {**OPENAI, "messages": MESSAGES, "max_completion_tokens": mostly(SMALL),
               "logprobs": mostly(st.booleans()), "top_logprobs": mostly(st.integers(-1, MAX_TOP_LOGPROBS + 1)),
               "tools": JSON,
               "response_format": mostly(st.fixed_dictionaries({"type": st.sampled_from(["text", "x"])}))}
IDS = st.lists(st.integers(-1, 49152), min_size=1, max_size=4)
COMPLETION_FIELDS = {**OPENAI, "prompt": mostly(TEXT | st.lists(TEXT, min_size=1, max_size=3) | IDS
                                                | st.lists(IDS, min_size=1, max_size=2)),
                     "logprobs": mostly(st.integers(-1, MAX_TOP_LOGPROBS + 1)), "echo": mostly(st.just(False)),
                     "suffix": mostly(st.none()), "best_of": mostly(SMALL)}
GENERATE_FIELDS = {**SAMPLING, "agent": mostly(st.sampled_from(["coder", "planner", "base"]), TEXT | JSON),
                   "text": TEXT, "messages": MESSAGES, "logprobs": mostly(st.integers(-1, MAX_TOP_LOGPROBS + 1))}


def bodies(fields: dict[str, st.SearchStrategy[Any]], required: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """Bodies with the required fields (one may be left out) and a few others, any of them wrong;
    1 time in 8 any JSON at all."""
    optional = sorted(set(fields) - set(required))

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        names = set(required) - draw(st.sets(st.sampled_from(required), max_size=1)) if draw(st.integers(0, 7)) == 7 \
            else set(required)
        names |= draw(st.sets(st.sampled_from(optional), max_size=5))
        return {name: draw(fields[name]) for name in sorted(names)}

    return mostly(build())


def assert_well_answered(r: httpx.Response) -> None:
    event(f"status {r.status_code}")  # the mix shows with --hypothesis-show-statistics
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        error_of(r)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.status_code == 200 and '"error"' not in r.text and r.text.endswith("data: [DONE]\n\n"), r.text[-500:]
    else:
        assert r.status_code in (200, 201), r.text[:500]


FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def fuzz_http(start_server: Callable[..., str]) -> Iterator[httpx.Client]:
    """A server of its own whose default limit is 2 tokens (fuzzed bodies often give none)."""
    with httpx.Client(base_url=start_server(default_max_tokens=2), timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def fuzz_context(fuzz_http: httpx.Client) -> str:
    r = fuzz_http.post("/v1/contexts", json={"text": "A shared document.", "ttl": 3600})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


@FUZZ
@given(body=bodies(CHAT_FIELDS, ("model", "messages")))
def test_fuzzed_chat_requests(fuzz_http: httpx.Client, body: Any) -> None:
    assert_well_answered(send(fuzz_http, CHAT_URL, body))


@FUZZ
@given(body=bodies(COMPLETION_FIELDS, ("model", "prompt")))
def test_fuzzed_completion_requests(fuzz_http: httpx.Client, body: Any) -> None:
    assert_well_answered(send(fuzz_http, COMPLETION_URL, body))


@FUZZ
@given(body=bodies(GENERATE_FIELDS, ("agent", "text")))
def test_fuzzed_generate_requests(fuzz_http: httpx.Client, fuzz_context: str, body: Any) -> None:
    assert_well_answered(send(fuzz_http, f"/v1/contexts/{fuzz_context}/generate", body))


def test_still_serving_after_the_fuzzing(fuzz_http: httpx.Client) -> None:
    assert_still_serving(fuzz_http)
    health = fuzz_http.get("/health").json()
    assert health["status"] == "ok" and health["waiting"] == 0


# ---- the per-tenant quota on pinned contexts -----------------------------------------------


def kv_capacity(url: str) -> int:
    text = httpx.get(url + "/metrics").text
    return int(float(re.search(r"^agentshare_kv_blocks_capacity (\S+)$", text, re.MULTILINE)[1]))  # type: ignore[index]


def words(n: int, tag: str) -> str:
    return f"[{tag}] " + " ".join(f"w{i}" for i in range(n))


def test_pinned_contexts_per_tenant_are_bounded_in_count(start_server: Callable[..., str]) -> None:
    url = start_server(api_keys=("alpha", "beta"), max_pinned_contexts=2)
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("alpha", "beta"))
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        ids = [c.post("/v1/contexts", json={"text": words(5, f"a{i}"), "ttl": 100}, headers=a) for i in range(2)]
        assert [r.status_code for r in ids] == [201, 201]
        r = c.post("/v1/contexts", json={"text": words(5, "a2"), "ttl": 100}, headers=a)
        assert r.status_code == 429, r.text
        err = error_of(r)
        assert (err["type"], err["code"], err["param"]) == ("rate_limit_error", "quota_exceeded", None)
        assert "at most 2 pinned contexts per tenant (max_pinned_contexts)" in err["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 100
        # another tenant is not affected; releasing one makes room again
        assert c.post("/v1/contexts", json={"text": words(5, "b0"), "ttl": 100}, headers=b).status_code == 201
        assert c.delete(f"/v1/contexts/{ids[0].json()['id']}", headers=a).json()["released"]
        assert c.post("/v1/contexts", json={"text": words(5, "a3"), "ttl": 100}, headers=a).status_code == 201
        assert 'agentshare_rejected_requests_total{reason="tenant_quota"} 1.0' in c.get("/metrics").text


def test_one_tenant_cannot_pin_the_whole_pool(start_server: Callable[..., str]) -> None:
    """With several API keys a tenant's pins hold at most half the pool (the default share)."""
    url = start_server(api_keys=("alpha", "beta"), kv_cache_bytes=2 << 20)
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("alpha", "beta"))
    share = kv_capacity(url) // 2
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        first = c.post("/v1/contexts", json={"text": words(80, "a-first"), "ttl": 100}, headers=a)
        assert first.status_code == 201, first.text
        held = first.json()["pinned_tokens"] // 16
        assert share // 2 < held <= share, (held, share)
        more = c.post("/v1/contexts", json={"text": words(80, "a-more"), "ttl": 100}, headers=a)
        assert more.status_code == 429, more.text
        err = error_of(more)
        assert err["code"] == "quota_exceeded"
        assert f"may hold {share} KV blocks (max_pinned_share 0.5" in err["message"]
        assert int(more.headers["Retry-After"]) >= 1
        # the other tenant still pins as much
        other = c.post("/v1/contexts", json={"text": words(80, "b-first"), "ttl": 100}, headers=b)
        assert other.status_code == 201, other.text
        # a context larger than a tenant's whole share can never fit: 413, not a 429 to retry
        huge = c.post("/v1/contexts", json={"text": words(4 * share * 16 // 5, "b-huge"), "ttl": 100}, headers=b)
        assert huge.status_code == 413 and error_of(huge)["param"] == "text", huge.text
        # generating from the pinned contexts still works
        g = c.post(f"/v1/contexts/{first.json()['id']}/generate", json={"agent": "coder", "text": "Go.",
                                                                       "max_tokens": 2}, headers=a)
        assert g.status_code == 200, g.text


def test_errors_quote_neither_prompts_nor_keys(start_server: Callable[..., str]) -> None:
    """A refusal says which field and why; it never echoes the prompt, or the key it was sent."""
    url = start_server(api_keys=("alpha",))
    secret, key = "zebra-quartz-secret-phrase", "wrong-key-7f3a"
    ok = {"Authorization": "Bearer alpha"}
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        refused = [
            c.post(CHAT_URL, json=chat(messages=user(secret)), headers={"Authorization": f"Bearer {key}"}),
            c.post(CHAT_URL, json=chat(messages=user(secret + " " + LONG)), headers=ok),
            c.post(CHAT_URL, json=chat(messages=user(secret), seed=2**64), headers=ok),
            c.post(COMPLETION_URL, json=completion(prompt=secret, stop=[secret] * (MAX_STOP + 1)), headers=ok),
            c.post("/v1/contexts", json={"text": secret, "ttl": -1}, headers=ok),
        ]
    assert [r.status_code for r in refused] == [401, 413, 422, 422, 422]
    for r in refused:
        error_of(r)
        assert secret not in r.text and key not in r.text, r.text
