"""Who is asking: tenants by API key, admins by token.

With no API keys configured every request is tenant "default" (a local cluster needs no keys).
With keys, a request without a known key is refused (401) before anything else happens, and its
tenant comes from the key alone: the tenant keys the session table, advisories, priority tiers and
the KV in the nodes' tiers, so one tenant can never advise, read or reuse another's sessions or KV.
Keys are looked up by digest (symphony.tenancy.TenantKeys); the admin token is compared in
constant time. Operational detail (/metrics, /readyz's details, /summary) is for the admin token
or the cluster's internal token once any key is set (`observer_refusal`), never a tenant's key.

The engines' own prefix caches are shared by every request they serve, so the scheduler also sets
each request's `cache_salt` from its tenant (`symphony.tenancy.engine_cache_salt`).
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler.errors import ApiError
from symphony.tenancy import DEFAULT_TENANT, TenantKeys, admin_refusal, bearer, observer_refusal

__all__ = ["Authenticator", "bearer"]


class Authenticator:
    def __init__(
        self,
        api_keys: list[str],
        admin_token: str,
        refuse_tenant: Callable[[str], ApiError | None] | None = None,
        secret: bytes = b"",
    ) -> None:
        self._keys = TenantKeys(api_keys)
        self._api_keys = api_keys
        self._admin = admin_token
        self._secret = secret  # the cluster's: its internal token reads operational detail
        # The error for a tenant this scheduler may not serve (data residency: a regional
        # scheduler refuses tenants whose data may not enter its region, whoever sends them).
        self._refuse = refuse_tenant

    @property
    def open(self) -> bool:
        return self._keys.open

    def tenant(self, authorization: str | None) -> str:
        tenant = self._tenant(authorization)
        if self._refuse is not None and (refused := self._refuse(tenant)) is not None:
            raise refused
        return tenant

    def _tenant(self, authorization: str | None) -> str:
        if self.open:
            return DEFAULT_TENANT
        token = bearer(authorization)
        if token is None:
            raise ApiError(401, "missing API key: send it as 'Authorization: Bearer <key>'", code="invalid_api_key")
        tenant = self._keys.tenant(token)
        if tenant is None:
            raise ApiError(401, "unknown API key", code="invalid_api_key")
        return tenant

    def observer(self, authorization: str | None) -> bool:
        """Whether `authorization` may read operational detail (`symphony.tenancy.observer_refusal`)."""
        return observer_refusal(self._api_keys, self._admin, self._secret, authorization) is None

    def check_observer(self, authorization: str | None) -> None:
        refused = observer_refusal(self._api_keys, self._admin, self._secret, authorization)
        if refused is not None:
            status, message, code = refused
            raise ApiError(status, message, code=code)

    def check_admin(self, authorization: str | None) -> None:
        refused = admin_refusal(self._admin, authorization)
        if refused is not None:
            status, message, code = refused
            raise ApiError(status, message, code=code)
