"""The admin API (`/admin/v1/...`, bearer `scheduler.admin_token`): priority tiers per tenant or per
session. Setting a session or a tenant to high moves the KV of its sessions to the top tier of
their nodes at once (`promoted`: how many moves started)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from scheduler.errors import ApiError
from scheduler.routing import PRIORITIES
from scheduler.state import SchedulerState
from scheduler.validation import check_session_id, parse_json_object

MAX_TENANT_LEN = 128


def admin_routes(state: SchedulerState) -> APIRouter:
    router = APIRouter(prefix="/admin/v1")

    @router.get("/priorities")
    async def list_priorities(request: Request) -> JSONResponse:
        state.auth.check_admin(request.headers.get("authorization"))
        return JSONResponse({"object": "priorities", **state.priorities.listing()})

    @router.put("/priorities")
    async def set_priority(request: Request) -> JSONResponse:
        state.auth.check_admin(request.headers.get("authorization"))
        body = parse_json_object(await request.body())
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
        return JSONResponse(
            {
                "object": "priority",
                "tenant": tenant,
                "session_id": session_id,
                "priority": priority,
                "promoted": promoted,
            }
        )

    return router


def _tenant(body: dict[str, Any]) -> str:
    tenant = body.get("tenant")
    if (
        not isinstance(tenant, str)
        or not tenant
        or len(tenant) > MAX_TENANT_LEN
        or not all("\x21" <= ch <= "\x7e" for ch in tenant)
    ):
        raise ApiError(400, f"tenant must be 1 to {MAX_TENANT_LEN} visible ASCII characters", param="tenant")
    return tenant
