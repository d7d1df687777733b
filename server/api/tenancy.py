"""Tenants: each API key is its own cache salt, so no tenant is ever served another's KV.

Without configured keys there is one tenant (salt ``""``) and no authentication. With keys,
a request must carry one (``Authorization: Bearer <key>``) or is refused with 401. The salt is
a digest of the key, so the key itself never reaches the engine, the cache keys or the logs.

>>> t = Tenancy(("alpha", "beta"))
>>> a, b = t.authenticate("Bearer alpha"), t.authenticate("Bearer beta")
>>> a.salt != b.salt and a.salt != "" and "alpha" not in a.salt
True
>>> Tenancy(()).authenticate(None).salt
''
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from server.api.errors import ApiError


@dataclass(frozen=True, slots=True)
class Tenant:
    salt: str  # cache salt: isolates this tenant's KV blocks
    label: str  # short, non-secret name for logs and metrics

    @classmethod
    def anonymous(cls) -> Tenant:
        return cls("", "default")


class Tenancy:
    """Map request credentials to tenants."""

    def __init__(self, api_keys: tuple[str, ...]) -> None:
        self._tenants = {key: _tenant_of(key) for key in api_keys}

    @property
    def required(self) -> bool:
        return bool(self._tenants)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header value; raises 401 if keys are configured
        and it carries none of them."""
        if not self._tenants:
            return Tenant.anonymous()
        if not authorization:
            raise _unauthorized("this server requires an API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise _unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        for known, tenant in self._tenants.items():  # constant-time compare per key
            if hmac.compare_digest(known.encode(), key.encode()):
                return tenant
        raise _unauthorized("invalid API key")


def salted(salt: str, cache_salt: str | None) -> str:
    """The cache salt of a request that carries vLLM's ``cache_salt`` field: its tenant's salt
    further divided, so requests with different values never share KV blocks, even in one tenant.

    >>> salted("", None), salted("", "a") == salted("", "a"), salted("", "a") != salted("t", "a")
    ('', True, True)
    """
    if cache_salt is None:
        return salt
    return hashlib.sha256(f"agentshare-cache-salt\x00{salt}\x00{cache_salt}".encode()).hexdigest()[:32]


def _tenant_of(key: str) -> Tenant:
    digest = hashlib.sha256(b"agentshare-tenant\x00" + key.encode()).hexdigest()
    return Tenant(salt=digest[:32], label=digest[:8])


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})
