"""The admin API (`/admin/v1/...`, bearer `scheduler.admin_token`): priority tiers per tenant or per
session; each tenant's quotas (`/admin/v1/quotas`, symphony.tenant_quotas: this scheduler's,
over `[quotas]`). Setting a session or a tenant to high moves the KV of its sessions to the top tier
of their nodes at once (`promoted`: how many moves started). A regional scheduler also takes
residency rules (`/admin/v1/residency`, symphony.residency_rules): a tenant refused here from the
next request on. Every change is saved once applied (scheduler.control) and restored at the next
start; one that cannot be saved is a 503 `state_not_saved` (it holds until a restart)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from scheduler.errors import ApiError
from scheduler.hot_path import read_body
from scheduler.routing import PRIORITIES
from scheduler.schemas import QuotaUpdateBody, check
from scheduler.state import SchedulerState
from scheduler.validation import check_session_id, parse_json_object
from symphony.control_state import Changed
from symphony.logs import get_logger
from symphony.regions import RegionTopology
from symphony.residency_rules import RuleError, known_tenants, listing, parse_update, with_rule
from symphony.tenancy import tenant_name_error

log = get_logger(__name__)


def admin_routes(state: SchedulerState) -> APIRouter:
    router = APIRouter(prefix="/admin/v1")

    @router.get("/priorities")
    async def list_priorities(request: Request) -> JSONResponse:
        state.auth.check_admin(request.headers.get("authorization"))
        return JSONResponse({"object": "priorities", **state.priorities.listing()})

    @router.put("/priorities")
    async def set_priority(request: Request) -> JSONResponse:
        state.auth.check_admin(request.headers.get("authorization"))
        body = parse_json_object(await read_body(request.scope, request.receive, state.config.scheduler.max_body_bytes))
        tenant = _tenant(body)
        session_id = None
        if body.get("session_id") is not None:
            session_id = check_session_id(body["session_id"], state.config.scheduler.max_session_id_len)
        priority = body.get("priority")
        if priority not in PRIORITIES:
            raise ApiError(400, f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}", param="priority")
        try:
            state.priorities.set(tenant, priority, session_id)
        except OverflowError as exc:
            raise ApiError(409, str(exc), code="priority_table_full") from None
        promoted = state.dispatcher.promote(tenant, session_id) if priority == "high" else 0
        await state.control.save(state, Changed(tenant, session_id))
        return JSONResponse(
            {
                "object": "priority",
                "tenant": tenant,
                "session_id": session_id,
                "priority": priority,
                "promoted": promoted,
            }
        )

    @router.get("/quotas")
    async def list_quotas(request: Request) -> JSONResponse:
        state.auth.check_admin(request.headers.get("authorization"))
        return JSONResponse({"object": "quotas", **state.quotas.listing()})

    @router.put("/quotas")
    async def set_quotas(request: Request) -> JSONResponse:
        state.auth.check_admin(request.headers.get("authorization"))
        body = parse_json_object(await read_body(request.scope, request.receive, state.config.scheduler.max_body_bytes))
        check(QuotaUpdateBody, body)
        tenant = _tenant(body)
        if tenant not in known_tenants(state.config.scheduler.api_keys):
            raise ApiError(404, f"tenant {tenant!r} has no API key here: its limits would never apply", param="tenant")
        limits = body["limits"]
        changes = None if limits is None else {k: v for k, v in limits.items() if v is not None}
        try:
            applied = state.quotas.set(tenant, changes)
        except ValueError as exc:
            raise ApiError(400, f"limits.{exc}", param="limits") from None
        log.info("tenant quotas set", tenant=tenant, limits="defaults" if limits is None else str(limits))
        state.control.quota_changed(tenant, changes)
        await state.control.save(state, Changed(tenant))
        return JSONResponse({"object": "quota", "tenant": tenant, "limits": dataclasses.asdict(applied)})

    @router.get("/residency")
    async def list_residency(request: Request) -> JSONResponse:
        state.auth.check_admin(request.headers.get("authorization"))
        topology = _regions(state)
        region = state.config.scheduler.region
        return JSONResponse({"object": "residency", "region": region, "rules": listing(topology)})

    @router.put("/residency")
    async def set_residency(request: Request) -> JSONResponse:
        state.auth.check_admin(request.headers.get("authorization"))
        _regions(state)
        body = parse_json_object(await read_body(request.scope, request.receive, state.config.scheduler.max_body_bytes))
        try:
            # The rules as they are once the body is in: a change made meanwhile is kept.
            topology = _regions(state)
            tenant, regions = parse_update(body, topology, known_tenants(state.config.scheduler.api_keys))
            state.topology = with_rule(topology, tenant, regions)
        except RuleError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except OverflowError as exc:
            raise ApiError(409, str(exc), code="residency_table_full") from None
        log.info("residency rule set", tenant=tenant, regions=",".join(sorted(regions)) if regions else "any")
        state.control.rule_changed(state, tenant)
        await state.control.save(state, Changed(tenant))
        rule = listing(state.topology).get(tenant)
        return JSONResponse({"object": "residency_rule", "tenant": tenant, "regions": rule})

    return router


def _regions(state: SchedulerState) -> RegionTopology:
    if state.topology is None or not state.config.scheduler.region:
        raise ApiError(404, "residency rules are a regional scheduler's: this one has no scheduler.region")
    return state.topology


def _tenant(body: dict[str, Any]) -> str:
    tenant = body.get("tenant")
    if (invalid := tenant_name_error(tenant)) is not None:
        raise ApiError(400, invalid, param="tenant")
    assert isinstance(tenant, str)
    return tenant
