"""Bad input gets a status and a message that says what to fix; the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http(server_url: str) -> httpx.Client:
    with httpx.Client(base_url=server_url, timeout=60) as c:
        yield c


def error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return str(body["message"])


@pytest.mark.parametrize(("body", "status", "words"), [
    ({**CHAT, "messages": "hi"}, 400, ["messages", "list"]),
    ({k: v for k, v in CHAT.items() if k != "model"}, 400, ["model", "required"]),
    ({**CHAT, "max_tokens": "many"}, 400, ["max_tokens", "integer"]),
    ({**CHAT, "messages": [{"role": "user"}]}, 422, ["content"]),
    ({**CHAT, "messages": []}, 422, ["messages", "at least 1"]),
    ({**CHAT, "max_tokens": -1}, 422, ["max_tokens", "greater than or equal to 1"]),
    ({**CHAT, "max_completion_tokens": 0}, 422, ["max_completion_tokens"]),
    ({**CHAT, "temperature": 5}, 422, ["temperature", "less than or equal to 2"]),
    ({**CHAT, "top_p": 0}, 422, ["top_p", "greater than 0"]),
    ({**CHAT, "n": 0}, 422, ["n"]),
    ({**CHAT, "logprobs": True, "top_logprobs": 50}, 422, ["top_logprobs"]),
    ({**CHAT, "stop": [""]}, 422, ["stop", "non-empty"]),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 422, ["role"]),
    ({**CHAT, "frequency_penalty": 0.5}, 422, ["frequency_penalty", "not supported"]),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 422, ["tools"]),
])
def test_bad_chat_requests(http: httpx.Client, body: dict, status: int, words: list[str]) -> None:
    message = error(http.post("/v1/chat/completions", json=body), status)
    assert all(w.lower() in message.lower() for w in words), message


def test_malformed_json(http: httpx.Client) -> None:
    message = error(http.post("/v1/chat/completions", content=b'{"model": "base", "messages": [',
                              headers={"content-type": "application/json"}), 400)
    assert "JSON" in message


def test_unknown_model_is_404_and_names_the_known(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    message = error(r, 404)
    assert r.json()["error"]["code"] == "model_not_found" and "coder" in message
    error(http.post("/v1/contexts/ctx_missing/generate", json={"agent": "coder", "text": "x"}), 404)
    error(http.get("/v1/nothing-here"), 404)


def test_oversize_prompt_is_413(http: httpx.Client) -> None:
    huge = {**CHAT, "messages": [{"role": "user", "content": "word " * 5000}]}
    message = error(http.post("/v1/chat/completions", json=huge), 413)
    assert "tokens" in message and "shorten" in message


def test_native_validation(http: httpx.Client) -> None:
    error(http.post("/v1/contexts", json={"messages": [{"role": "user", "content": "x"}], "text": "y"}), 422)
    error(http.post("/v1/contexts", json={"text": "x", "ttl": -5}), 422)
    error(http.post("/v1/contexts", json={"text": "x", "ttl": 10**9}), 422)
    error(http.post("/v1/explain", json={"agent": "nope", "prompt": "x"}), 404)
    error(http.post("/v1/completions", json={"model": "base", "prompt": "x", "echo": True}), 422)


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
