"""API keys: refused without one, and each key's cache is its own."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "Tenant document. " + "secret ledger line. " * 20},
            {"role": "user", "content": "Total?"}]


@pytest.fixture(scope="module")
def url(start_server: Callable[..., str]) -> str:
    return start_server(api_keys=("alpha-key", "beta-key"))


def cached(url: str, key: str) -> int:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    res = client.chat.completions.create(model="coder", messages=MESSAGES, max_tokens=2, temperature=0)
    assert res.usage is not None and res.usage.prompt_tokens_details is not None
    return res.usage.prompt_tokens_details.cached_tokens or 0


def test_missing_or_invalid_keys_are_refused(url: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", json={"model": "base", "messages": MESSAGES})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(url + "/health").status_code == 200  # operations stay open


def test_no_cached_tokens_across_keys(url: str) -> None:
    assert cached(url, "alpha-key") == 0
    assert cached(url, "alpha-key") > 0  # the same tenant hits its own cache
    assert cached(url, "beta-key") == 0  # another tenant never does
    assert cached(url, "beta-key") > 0


def test_contexts_belong_to_their_tenant(url: str) -> None:
    alpha = {"Authorization": "Bearer alpha-key"}
    beta = {"Authorization": "Bearer beta-key"}
    doc = "A context only alpha has prefilled. " * 12
    ctx = httpx.post(url + "/v1/contexts", json={"text": doc}, headers=alpha).json()
    assert ctx["cached_tokens"] == 0
    assert httpx.get(url + f"/v1/contexts/{ctx['id']}", headers=beta).status_code == 404
    assert httpx.delete(url + f"/v1/contexts/{ctx['id']}", headers=beta).status_code == 404
    again = httpx.post(url + "/v1/contexts", json={"text": doc}, headers=beta).json()
    assert again["cached_tokens"] == 0  # beta prefilled its own copy
    assert httpx.get(url + f"/v1/contexts/{ctx['id']}", headers=alpha).status_code == 200
