"""Who is asking: tenants by API key, admins by token.

With no API keys configured every request is tenant "default" (a local cluster needs no keys).
With keys, a request without a known key is refused (401) before anything else happens, and its
tenant comes from the key alone: the tenant keys the session table, advisories, priority tiers and
the KV in the nodes' tiers, so one tenant can never advise, read or reuse another's sessions or KV.
Keys are kept as sha256 digests and looked up by digest, so the lookup's timing says nothing about
how much of a guessed key was right; the admin token is compared in constant time.

The engines' own prefix caches are shared by every request they serve, so the scheduler also sets
each request's `cache_salt` from its tenant (`symphony.tenancy.engine_cache_salt`).
"""

from __future__ import annotations

import hashlib
import hmac

from scheduler.errors import ApiError
from symphony.tenancy import DEFAULT_TENANT


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, None when absent or of another kind."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class Authenticator:
    def __init__(self, api_keys: list[str], admin_token: str) -> None:
        # Config entries are "tenant:key" (validated by symphony.config).
        self._tenants = {_digest(key): tenant for tenant, _, key in (entry.partition(":") for entry in api_keys)}
        self._admin = admin_token.encode()

    @property
    def open(self) -> bool:
        return not self._tenants

    def tenant(self, authorization: str | None) -> str:
        if self.open:
            return DEFAULT_TENANT
        token = bearer(authorization)
        if token is None:
            raise ApiError(401, "missing API key: send it as 'Authorization: Bearer <key>'", code="invalid_api_key")
        tenant = self._tenants.get(_digest(token))
        if tenant is None:
            raise ApiError(401, "unknown API key", code="invalid_api_key")
        return tenant

    def check_admin(self, authorization: str | None) -> None:
        if not self._admin:
            raise ApiError(403, "the admin API is off: set scheduler.admin_token to use it", code="admin_disabled")
        token = bearer(authorization)
        if token is None:
            raise ApiError(
                401, "missing admin token: send it as 'Authorization: Bearer <token>'", code="missing_admin_token"
            )
        if not hmac.compare_digest(token.encode(), self._admin):
            raise ApiError(403, "wrong admin token", code="invalid_admin_token")
