"""API keys: refused without one, and each key's cache is its own."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import httpx
import openai
import pytest

from server.api.errors import ApiError
from server.api.tenancy import Tenancy, Tenant, salted

MESSAGES = [{"role": "user", "content": "Tenant document. " + "secret ledger line. " * 20},
            {"role": "user", "content": "Total?"}]


# ---- the rules, without a server (scripts/mutation selects them with -k "authenticate or salt")


def test_authenticate_without_keys_is_one_anonymous_tenant() -> None:
    open_server = Tenancy(())
    assert not open_server.required
    for header in (None, "", "Bearer anything", "Basic x"):
        assert open_server.authenticate(header) == Tenant("", "default") == Tenant.anonymous()


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer   ", "Basic alpha", "alpha", "Bearer alphax",
                                    "Bearer alph", "Bearer gamma"])
def test_authenticate_refuses_a_missing_malformed_or_unknown_key(header: str | None) -> None:
    with pytest.raises(ApiError) as info:
        Tenancy(("alpha", "beta")).authenticate(header)
    err = info.value
    assert (err.status, err.type, err.code) == (401, "authentication_error", "invalid_api_key")
    assert err.headers == {"WWW-Authenticate": "Bearer"}
    assert isinstance(err.message, str) and err.message  # says what was wrong


def test_authenticate_maps_each_key_to_its_own_tenant() -> None:
    t = Tenancy(("alpha", "beta"))
    assert t.required
    alpha = t.authenticate("Bearer alpha")
    assert t.authenticate("bearer alpha") == t.authenticate("BEARER  alpha ") == alpha  # scheme any case
    beta = t.authenticate("Bearer beta")
    assert alpha != beta and alpha.salt != beta.salt and alpha.label != beta.label
    assert Tenancy(("beta", "alpha")).authenticate("Bearer alpha") == alpha  # order of keys irrelevant


def test_salt_is_a_stable_digest_that_hides_the_key() -> None:
    # Every router and worker must derive the same salt from a key, in every process and
    # release, or tenants' caches split: the derivation is part of the contract.
    tenant = Tenancy(("alpha-key",)).authenticate("Bearer alpha-key")
    digest = hashlib.sha256(b"agentshare-tenant\x00alpha-key").hexdigest()
    assert tenant == Tenant(salt=digest[:32], label=digest[:8])
    assert "alpha" not in tenant.salt and tenant.salt != ""


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


def test_salted_divides_a_tenant_by_cache_salt() -> None:
    assert salted("t", None) == "t"  # no cache_salt: the tenant's own salt
    assert salted("t", "a") == salted("t", "a") != salted("t", "b")
    assert salted("t", "a") != salted("u", "a") and salted("t", "a") not in ("t", "a", "")
    digest = hashlib.sha256(b"agentshare-cache-salt\x00t\x00a").hexdigest()[:32]
    assert salted("t", "a") == digest  # part of the contract: every router and worker derives it alike


def test_cache_salt_keeps_requests_of_one_tenant_apart(url: str) -> None:
    # vLLM's cache_salt field: the same tenant, the same prompt, different salts share no block
    # (a system message of its own: no earlier test's template block in common)
    messages = [{"role": "system", "content": "Salted document. " + "ledger line of the salted case. " * 20},
                {"role": "user", "content": "Total?"}]

    def cached_with(salt: str | None) -> int:
        body = {"model": "coder", "messages": messages, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer alpha-key"})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached_with("agent-a") == 0
    assert cached_with("agent-a") > 0  # one salt hits its own cache
    assert cached_with("agent-b") == 0  # another salt never does
    assert cached_with(None) == 0  # nor does the unsalted tenant
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer alpha-key"},
                   json={"model": "coder", "messages": messages, "max_tokens": 1, "cache_salt": ""})
    assert r.status_code in (400, 422) and "cache_salt" in r.text
