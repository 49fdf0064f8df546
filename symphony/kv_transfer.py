"""The `kv_transfer_params` a request carries to Symphony's KV connector inside vLLM: the contract
between whoever sends requests to an engine (the scheduler, the node manager's warm-ups, a client
talking to an engine directly) and the connector.

The params are signed. Whoever sends a request through the tiers (the scheduler, a warm-up) adds
`AUTH_PARAM`: an expiry and an HMAC-SHA256, under a key derived from the cluster's secret
(`params_key`), of the other params and the model the request names. The connector takes a request
onto the tiers only when the signature checks out (`params_refusal`): a client that calls an engine
directly, with no signature or a forged, altered or expired one, is served by vLLM alone and never
loads or saves a tenant's KV. A clock skew between hosts smaller than `PARAMS_TTL_S` is absorbed.

What it does not cover: the prompt. Params seen on the scheduler-to-engine wire can be replayed,
with any prompt, to that model's engines until they expire (at most `PARAMS_TTL_S`); that wire is
plain HTTP on the cluster's own network (`cluster.tls` does not cover it yet). Params are checked
once, when the engine first considers the request: one queued in vLLM past its expiry runs alone.
`params_refusal` never raises, whatever a client put in the params: it runs in vLLM's scheduler loop.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping

TENANT_PARAM = "tenant"  # whose KV: keys are namespaced by tenant, so tenants never share any
SESSION_PARAM = "session_id"  # which session's history the request continues
TIERS_PARAM = "symphony_tiers"  # false: neither load from nor save to Symphony's tiers (vLLM alone)
AUTH_PARAM = "symphony_auth"  # "<expiry, unix ms>.<hex HMAC>" (`sign_params`)
PARAMS_TTL_S = 300.0  # how long a signature stands
_KEY_LABEL = b"symphony kv_transfer_params v1"
_MAC_HEX_CHARS = 32  # 128 bits of the HMAC
_AUTH = re.compile(r"([0-9]{1,16})\.([0-9a-f]{32})")  # ASCII digits only: int() takes other digits too


def params_key(secret: bytes) -> bytes:
    """The key that signs the params: derived from the cluster's secret, so an engine, which holds
    this key to check signatures, learns nothing of the secret itself."""
    return hmac.digest(secret, _KEY_LABEL, hashlib.sha256)


def _mac(key: bytes, params: Mapping[str, object], model: str, expires_ms: int) -> str:
    signed = {name: value for name, value in params.items() if name != AUTH_PARAM}
    message = json.dumps([model, expires_ms, signed], sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:_MAC_HEX_CHARS]


def sign_params(params: Mapping[str, object], model: str, key: bytes, now_s: float) -> dict[str, object]:
    """`params` with their signature for a request that names `model`, standing until `now_s`
    (unix seconds) + `PARAMS_TTL_S`. Values must be JSON scalars (they are: names, flags, ints)."""
    expires_ms = int((now_s + PARAMS_TTL_S) * 1000)
    return {**params, AUTH_PARAM: f"{expires_ms}.{_mac(key, params, model, expires_ms)}"}


def params_refusal(params: Mapping[str, object], model: str, key: bytes, now_s: float) -> str | None:
    """Why the connector must not trust `params` for a request to `model` at `now_s`: "no key" (the
    node has none to check with), "unsigned", "malformed", "expired" or "forged" (another key,
    other params or another model); None when they are signed and current. Never raises."""
    if not key:
        return "no key"
    auth = params.get(AUTH_PARAM)
    if auth is None:
        return "unsigned"
    match = _AUTH.fullmatch(auth) if isinstance(auth, str) else None
    if match is None:
        return "malformed"
    expires, mac = int(match[1]), match[2]
    if expires < now_s * 1000:
        return "expired"
    if expires > (now_s + 2 * PARAMS_TTL_S) * 1000:  # no signer gives that much: a clock far off, or not ours
        return "malformed"
    try:
        expected = _mac(key, params, model, expires)
    except (TypeError, ValueError, RecursionError):  # params no signer makes (deep, huge, not JSON)
        return "malformed"
    return None if hmac.compare_digest(mac.encode(), expected.encode()) else "forged"
