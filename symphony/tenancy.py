"""Tenants as every process names them: the default tenant, and the `cache_salt` an engine gets
with a tenant's request.

The scheduler sets each request's `cache_salt` from its tenant (`engine_cache_salt`), so vLLM's own
prefix cache, which every request of an engine shares, never serves one tenant's blocks to another
(without it a tenant could time, or read in `usage.prompt_tokens_details.cached_tokens`, whether
another tenant sent a given prompt). A node computes the same salts to tell whose blocks vLLM's KV
events name (`node_manager/engine_event_keys.py`).

The salts are keyed by the cluster's secret (`cluster.secret`, else the one kept in the home,
`symphony.config_secrets`), so that nobody who reaches an engine directly can compute a tenant's salt from its
name and probe that tenant's cache. With no secret they are plain digests."""

from __future__ import annotations

import hashlib
import hmac

DEFAULT_TENANT = "default"  # every request's tenant when the scheduler has no API keys
_SALT_DOMAIN = b"symphony-engine-cache-salt\0"


def engine_cache_salt(tenant: str, client_salt: str | None = None, key: bytes = b"") -> str:
    """The `cache_salt` an engine gets with a tenant's request: a digest of the tenant (and of the
    client's own salt, which may split a tenant's cache further but never joins another's), an
    HMAC-SHA256 under `key` (the cluster's secret) when there is one. Clients cannot choose it: the
    scheduler overwrites whatever they send. 32 hex digits."""
    name = tenant.encode()
    material = len(name).to_bytes(4, "big") + name  # length-prefixed: no tenant/salt split collides
    if client_salt is not None:
        material += client_salt.encode()
    if key:
        return hmac.new(key, _SALT_DOMAIN + material, hashlib.sha256).hexdigest()[:32]
    return hashlib.sha256(_SALT_DOMAIN + material).hexdigest()[:32]


def secret_check(key: bytes) -> bytes:
    """What processes of a cluster compare to learn they share its secret (`key`) without sending
    it: the first 8 bytes of an HMAC of a fixed label under it; b"" for no secret."""
    return hmac.new(key, b"symphony-secret-check", hashlib.sha256).digest()[:8] if key else b""


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, None when absent or of another kind."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


MAX_TENANT_LEN = 128  # a tenant name the admin APIs accept


def tenant_name_error(tenant: object) -> str | None:
    """Why `tenant` is no tenant name the admin APIs accept (None: it is one): 1 to
    MAX_TENANT_LEN visible ASCII characters."""
    if isinstance(tenant, str) and 0 < len(tenant) <= MAX_TENANT_LEN and all("\x21" <= ch <= "\x7e" for ch in tenant):
        return None
    return f"tenant must be 1 to {MAX_TENANT_LEN} visible ASCII characters"


def admin_refusal(admin_token: str, authorization: str | None) -> tuple[int, str, str] | None:
    """None when `authorization` carries the admin token; else the answer: (status, message,
    code). An empty token turns the admin API off. Compared in constant time."""
    if not admin_token:
        return 403, "the admin API is off: set scheduler.admin_token to use it", "admin_disabled"
    token = bearer(authorization)
    if token is None:
        return 401, "missing admin token: send it as 'Authorization: Bearer <token>'", "missing_admin_token"
    if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), admin_token.encode()):
        return 403, "wrong admin token", "invalid_admin_token"
    return None


def internal_token(secret: bytes) -> str:
    """The bearer token the cluster's own processes (the global layer, `symphony status`, the
    launcher, benchmarks) read operational endpoints with: derived from the cluster's secret, so
    it needs no configuring and says nothing of the secret. 48 hex digits."""
    return hmac.new(secret, b"symphony-internal-token", hashlib.sha256).hexdigest()[:48]


def internal_headers(secret: str) -> dict[str, str]:
    """The `Authorization` header of `internal_token` for a cluster whose secret is `secret`."""
    return {"Authorization": f"Bearer {internal_token(secret.encode())}"}


ENGINE_KEY_ENV = "SYMPHONY_ENGINE_KEY"  # how a node manager hands its engine the key (node_manager.engine_auth)


def engine_key(secret: bytes) -> str:
    """The bearer token a node's vLLM engine demands of every caller (`node_manager.engine_auth`):
    derived from the cluster's secret, so the cluster's own processes (the node manager, the
    scheduler, benchmarks given the configuration) hold it and a client holds nothing that opens
    an engine. "" with no secret: the engine is then unguarded. 48 hex digits."""
    return hmac.new(secret, b"symphony-engine-key", hashlib.sha256).hexdigest()[:48] if secret else ""


def engine_headers(secret: str) -> dict[str, str]:
    """The `Authorization` header an engine of a cluster whose secret is `secret` accepts ({} with
    no secret)."""
    key = engine_key(secret.encode())
    return {"Authorization": f"Bearer {key}"} if key else {}


def observer_refusal(
    api_keys: list[str], admin_token: str, secret: bytes, authorization: str | None
) -> tuple[int, str, str] | None:
    """None when `authorization` may read operational detail (/metrics, /readyz's details, a
    region's /summary, the global layer's /regions); else the answer: (status, message, code).

    Open while no key is set (no API keys and no admin token: a local cluster); once one is, the
    admin token or the cluster's `internal_token` is needed, compared in constant time. Tenants'
    API keys are not enough: the detail spans every tenant."""
    if not api_keys and not admin_token:
        return None
    token = bearer(authorization)
    if token is None:
        return 401, "missing token: send the admin token as 'Authorization: Bearer <token>'", "missing_token"
    given = token.encode("utf-8", "surrogateescape")
    # With no secret the internal token is public (an HMAC under an empty key): not accepted then.
    allowed = ([internal_token(secret).encode()] if secret else []) + ([admin_token.encode()] if admin_token else [])
    matches = [hmac.compare_digest(given, token) for token in allowed]  # each compared: no early exit
    if not any(matches):
        return 403, "this token may not read the cluster's operational detail", "invalid_token"
    return None


class TenantKeys:
    """Tenants by API key, from `scheduler.api_keys` ("tenant:key" entries, validated by
    symphony.config). Keys are kept as sha256 digests and looked up by digest, so the lookup's
    timing says nothing about how much of a guessed key was right."""

    def __init__(self, api_keys: list[str]) -> None:
        self._tenants = {_digest(key): tenant for tenant, _, key in (entry.partition(":") for entry in api_keys)}

    @property
    def open(self) -> bool:
        """No keys: every request is DEFAULT_TENANT's."""
        return not self._tenants

    def tenant(self, token: str) -> str | None:
        """The tenant whose key `token` is; None for an unknown key."""
        return self._tenants.get(_digest(token))


def _digest(key: str) -> bytes:
    # surrogateescape: a header's undecodable bytes (aiohttp keeps them as surrogates) are a wrong
    # key like any other, not an error.
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
