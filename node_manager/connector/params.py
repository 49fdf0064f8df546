"""What the connector makes of a request's `kv_transfer_params` (`symphony.kv_transfer`): whose KV
it is, which session it continues, whether it is the node manager's warm-up, and whether it may use
the tiers at all. Pure: the key and the time come in.

Only params signed under the node's key are believed. Anything else (no params, unsigned, forged,
altered, expired, or a node with no key to check with) gets the tiers turned off and nothing the
client chose: the default tenant, a session of the request's own id, no warm-up flag. So a client
that calls an engine directly can neither load a tenant's KV, nor save under its name, nor touch
the warm-up bookkeeping of another session."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from node_manager.kv.ipc_wire import WARMUP_PARAM
from symphony.kv_transfer import SESSION_PARAM, TENANT_PARAM, TIERS_PARAM, params_refusal
from symphony.tenancy import DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class RequestParams:
    tenant: str
    session: str
    warmup: bool  # the node manager's own warm-up of a prefetched session
    tiers: bool  # may load from and save to the node's tiers
    refusal: str | None = None  # why the params were not believed (`params_refusal`); None: they were


def read_params(
    params: Mapping[str, object] | None, request_id: str, model: str, key: bytes | None, now_s: float
) -> RequestParams:
    """`params` of request `request_id` to `model` (its served name), checked under `key` (None or
    empty: the node manager has given none) at `now_s` (unix seconds). Never raises."""
    params = params if isinstance(params, Mapping) else {}
    refusal = params_refusal(params, model, key or b"", now_s)
    if refusal is not None:
        return RequestParams(DEFAULT_TENANT, f"request-{request_id}", warmup=False, tiers=False, refusal=refusal)
    return RequestParams(
        str(params.get(TENANT_PARAM) or DEFAULT_TENANT),
        str(params.get(SESSION_PARAM) or f"request-{request_id}"),
        warmup=params.get(WARMUP_PARAM) is True,
        tiers=params.get(TIERS_PARAM) is not False,
    )
