"""Bad input gets a status and a message that says what to fix; the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.api.config import ServerConfig
from server.engine.async_engine import AsyncEngine
from server.engine.core import EngineCore
from tests.server.helpers import running_server

CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http(server_url: str) -> httpx.Client:
    with httpx.Client(base_url=server_url, timeout=60) as c:
        yield c


def post_json(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """POST ``body`` as ASCII JSON (escaped, as clients send it: a lone surrogate travels as ``\\ud800``)."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return str(body["message"])


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({**CHAT, "messages": "hi"}, 400, "messages", ["messages", "list"]),
    ({k: v for k, v in CHAT.items() if k != "model"}, 400, "model", ["model", "required"]),
    ({**CHAT, "max_tokens": "many"}, 400, "max_tokens", ["max_tokens", "integer"]),
    ({**CHAT, "messages": [{"role": "user"}]}, 422, "messages", ["content", "needs"]),
    ({**CHAT, "messages": []}, 422, "messages", ["messages", "at least 1"]),
    ({**CHAT, "max_tokens": -1}, 422, "max_tokens", ["max_tokens", "greater than or equal to 1"]),
    ({**CHAT, "max_completion_tokens": 0}, 422, "max_completion_tokens", ["max_completion_tokens"]),
    ({**CHAT, "temperature": 5}, 422, "temperature", ["temperature", "less than or equal to 2"]),
    ({**CHAT, "top_p": 0}, 422, "top_p", ["top_p", "greater than 0"]),
    ({**CHAT, "n": 0}, 422, "n", ["n: ", "greater than or equal to 1"]),
    ({**CHAT, "n": 17}, 422, "n", ["n: ", "less than or equal to 16"]),
    ({**CHAT, "seed": 2**64}, 422, "seed", ["seed", "less than 18446744073709551616"]),
    ({**CHAT, "seed": 2**64 - 1, "n": 2}, 422, "seed", ["seed + n - 1", "below 2**64"]),
    ({**CHAT, "logprobs": True, "top_logprobs": 50}, 422, "top_logprobs", ["top_logprobs", "20"]),
    ({**CHAT, "stop": [""]}, 422, "stop", ["stop", "non-empty"]),
    ({**CHAT, "stop": [f"s{i}" for i in range(17)]}, 422, "stop", ["stop", "at most 16 stop sequences, got 17"]),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 422, "messages", ["role"]),
    ({**CHAT, "messages": [{"role": "user", "content": "a \ud800 b"}]}, 400, "messages",
     ["messages.0.content", "lone surrogate", "U+D800", "valid UTF-8"]),
    ({**CHAT, "min_p": 0.1}, 400, "min_p", ["min_p", "not supported", "omit it", "or 0"]),
    ({**CHAT, "use_beam_search": True}, 400, "use_beam_search", ["use_beam_search", "not supported", "false"]),
    ({**CHAT, "frequency_penalty": 2.5}, 422, "frequency_penalty", ["frequency_penalty", "less than or equal to 2"]),
    ({**CHAT, "presence_penalty": -3}, 422, "presence_penalty", ["presence_penalty", "greater than or equal to -2"]),
    ({**CHAT, "repetition_penalty": 0}, 422, "repetition_penalty", ["repetition_penalty", "greater than 0"]),
    ({**CHAT, "logit_bias": {"42": 3}}, 422, "logit_bias", ["logit_bias", "not supported"]),
    ({**CHAT, "tools": [{"type": "web", "function": {"name": "f"}}]}, 422, "tools", ["tools", "function"]),
    ({**CHAT, "response_format": {"type": "xml"}}, 422, "response_format", ["response_format", "json_schema"]),
])
def test_bad_chat_requests(http: httpx.Client, body: dict, status: int, param: str, words: list[str]) -> None:
    r = post_json(http, "/v1/chat/completions", body)
    message = error(r, status)
    assert r.json()["error"]["param"] == param, r.json()
    assert all(w.lower() in message.lower() for w in words), message


@pytest.mark.parametrize(("fields", "status", "param", "words"), [
    ({"suffix": "!"}, 422, "suffix", ["suffix", "not supported"]),
    ({"echo": True}, 422, "echo", ["echo", "not supported"]),
    ({"best_of": 2}, 422, "best_of", ["best_of", "best_of == n"]),
    ({"best_of": 3, "n": 2}, 422, "best_of", ["best_of", "best_of == n"]),
    ({"logit_bias": {"42": 3}}, 422, "logit_bias", ["logit_bias"]),
    ({"min_tokens": 4}, 400, "min_tokens", ["min_tokens", "not supported"]),
    ({"typical_p": 0.9}, 400, "typical_p", ["typical_p", "not supported"]),
    ({"presence_penalty": 2.5}, 422, "presence_penalty", ["presence_penalty"]),
    ({"frequency_penalty": -2.5}, 422, "frequency_penalty", ["frequency_penalty"]),
    ({"stop": [f"s{i}" for i in range(17)]}, 422, "stop", ["at most 16"]),
    ({"logprobs": 21}, 422, "logprobs", ["logprobs", "20"]),
    ({"prompt": [5, 10**9]}, 422, "prompt", ["token id 1000000000 at position 1", "outside the vocabulary"]),
    ({"prompt": [-1]}, 422, "prompt", ["token id -1", "outside the vocabulary"]),
    ({"prompt": [[1, 2], []]}, 422, "prompt", ["empty list of token ids"]),
    ({"prompt": []}, 422, "prompt", ["send a string"]),
    ({"prompt": ["text", [1, 2]]}, 400, "prompt", ["prompt"]),
    ({"prompt": [1] * 5000}, 413, "prompt", ["5001 tokens", "4096", "shorten the prompt"]),
    ({"prompt": "a \ud800 b"}, 400, "prompt", ["lone surrogate"]),
])
def test_bad_completion_requests(http: httpx.Client, fields: dict, status: int, param: str, words: list[str]) -> None:
    r = post_json(http, "/v1/completions", {"model": "base", "prompt": "x", "max_tokens": 2, **fields})
    message = error(r, status)
    assert r.json()["error"]["param"] == param, r.json()
    assert all(w.lower() in message.lower() for w in words), message


def test_token_id_prompts_are_served(http: httpx.Client) -> None:
    """The refusals above are about the ids, not the form: valid ids, single and batched, serve."""
    r = http.post("/v1/completions", json={"model": "base", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1] and r.json()["usage"]["prompt_tokens"] == 5


def test_malformed_json(http: httpx.Client) -> None:
    message = error(http.post("/v1/chat/completions", content=b'{"model": "base", "messages": [',
                              headers={"content-type": "application/json"}), 400)
    assert "JSON" in message


def param_of(r: httpx.Response, status: int) -> str | None:
    error(r, status)
    return r.json()["error"]["param"]  # type: ignore[no-any-return]


def test_unknown_model_is_404_and_names_the_known(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    message = error(r, 404)
    assert r.json()["error"]["code"] == "model_not_found" and "coder" in message
    assert r.json()["error"]["param"] == "model"
    assert param_of(http.post("/v1/contexts/ctx_missing/generate", json={"agent": "coder", "text": "x"}),
                    404) == "context_id"
    assert param_of(http.get("/v1/nothing-here"), 404) is None


def test_oversize_prompt_is_413(http: httpx.Client) -> None:
    huge = {**CHAT, "messages": [{"role": "user", "content": "word " * 5000}]}
    r = http.post("/v1/chat/completions", json=huge)
    message = error(r, 413)
    assert "tokens" in message and "shorten" in message
    assert r.json()["error"]["param"] == "messages" and r.json()["error"]["code"] == "context_length_exceeded"


def test_native_validation(http: httpx.Client) -> None:
    both = {"messages": [{"role": "user", "content": "x"}], "text": "y"}
    assert param_of(http.post("/v1/contexts", json=both), 422) == "messages"
    assert param_of(http.post("/v1/contexts", json={"text": "x", "ttl": -5}), 422) == "ttl"
    assert param_of(http.post("/v1/contexts", json={"text": "x", "ttl": 10**9}), 422) == "ttl"
    assert param_of(http.post("/v1/contexts", json={"text": "word " * 5000}), 413) == "text"
    assert param_of(http.post("/v1/explain", json={"agent": "nope", "prompt": "x"}), 404) == "agent"
    ctx = http.post("/v1/contexts", json={"text": "a short shared text"}).json()["id"]
    gen = f"/v1/contexts/{ctx}/generate"
    assert param_of(http.post(gen, json={"agent": "nope", "text": "x"}), 404) == "agent"
    assert param_of(http.post(gen, json={"agent": "coder", "text": "x", "seed": -1}), 422) == "seed"
    assert param_of(http.post(gen, json={"agent": "coder", "text": "word " * 5000}), 413) == "text"
    assert param_of(http.post(gen, json={"agent": "coder", "messages": [{"role": "user", "content": "x"}]}),
                    422) == "messages"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", {"model": "base", "prompt": "Count:", "stream": True}),
    ("/v1/contexts/{ctx}/generate", {"agent": "coder", "text": "Count:", "stream": True}),
])
def test_an_error_in_the_middle_of_a_stream_is_an_error_chunk(tiny_core: EngineCore, path: str, body: dict) -> None:
    """The engine stops while a stream runs (a shutdown): the stream ends with one chunk in
    OpenAI's error shape, after the tokens already sent, and no ``[DONE]``."""
    config = ServerConfig(kv_cache_bytes=16 << 20)
    engine = AsyncEngine(tiny_core.with_config(config.engine_config()))
    with running_server(engine, config) as url, httpx.Client(base_url=url, timeout=60) as c:
        if "{ctx}" in path:
            path = path.replace("{ctx}", c.post("/v1/contexts", json={"text": "A shared text."}).json()["id"])
        long = {**body, "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
        with c.stream("POST", path, json=long) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "error" not in json.loads(first.removeprefix("data: "))
            engine.close()  # mid-stream
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert rest and "[DONE]" not in rest, rest[-3:]
    last = json.loads(rest[-1])
    assert set(last) == {"error"} and set(last["error"]) == {"message", "type", "param", "code"}, last
    assert (last["error"]["type"], last["error"]["code"], last["error"]["param"]) == (
        "service_unavailable", "cancelled", None)
    assert all("error" not in json.loads(x) for x in rest[:-1])


def test_openai_client_raises_an_error_chunk(tiny_core: EngineCore) -> None:
    config = ServerConfig(kv_cache_bytes=16 << 20)
    engine = AsyncEngine(tiny_core.with_config(config.engine_config()))
    with running_server(engine, config) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        stream = client.chat.completions.create(model="base", messages=CHAT["messages"], max_tokens=2000,
                                                stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        engine.close()
        with pytest.raises(openai.APIError, match="cancelled"):
            for _ in stream:
                pass


def test_openai_client_raises_its_own_error_types(server_url: str) -> None:
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT["messages"])
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="base", messages=CHAT["messages"], max_tokens=-3)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="base", messages=[{"role": "user", "content": "word " * 5000}])
    assert info.value.status_code == 413


def test_the_server_still_answers(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert http.get("/health").json()["status"] == "ok"
