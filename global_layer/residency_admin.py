"""The global layer's residency admin API (`GET`/`PUT /admin/v1/residency` on any entry, bearer
`scheduler.admin_token`): every entry of the process reads one `SharedTopology`, so a rule set
through one entry holds at all of them from the next request on (symphony.residency_rules)."""

from __future__ import annotations

import json

from aiohttp import web
from aiohttp.http_exceptions import PayloadEncodingError
from aiohttp.web_protocol import RequestPayloadError

from symphony.api_errors import error_body
from symphony.config import SymphonyConfig
from symphony.logs import get_logger
from symphony.regions import RegionTopology
from symphony.residency_rules import RuleError, known_tenants, listing, parse_update, with_rule
from symphony.tenancy import admin_refusal

log = get_logger(__name__)


class SharedTopology:
    """The regions and residency rules the entries route by; `current` is replaced whole (one
    assignment on the event loop), never changed in place."""

    def __init__(self, topology: RegionTopology) -> None:
        self.current = topology


def add_residency_routes(app: web.Application, config: SymphonyConfig, shared: SharedTopology) -> None:
    tenants = known_tenants(config.scheduler.api_keys)

    def refused(request: web.Request) -> web.Response | None:
        refusal = admin_refusal(config.scheduler.admin_token, request.headers.get("Authorization"))
        if refusal is None:
            return None
        status, message, code = refusal
        return _error(status, message, code=code)

    async def list_rules(request: web.Request) -> web.Response:
        if (answer := refused(request)) is not None:
            return answer
        return web.json_response({"object": "residency", "region": None, "rules": listing(shared.current)})

    async def set_rule(request: web.Request) -> web.Response:
        if (answer := refused(request)) is not None:
            return answer
        try:
            raw = await request.read()  # bounded by the app's client_max_size
        except web.HTTPRequestEntityTooLarge:
            limit = config.scheduler.max_body_bytes
            return _error(413, f"request body larger than {limit} bytes", code="body_too_large")
        except (RequestPayloadError, PayloadEncodingError) as exc:  # a broken chunked or compressed body
            return _error(400, f"the request body could not be read: {exc}", code="invalid_body")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON (or not UTF-8), or nested past Python's stack
            return _error(400, "the request body is not valid JSON")
        try:
            tenant, regions = parse_update(body, shared.current, tenants)
            shared.current = with_rule(shared.current, tenant, regions)
        except RuleError as exc:
            return _error(400, str(exc), param=exc.param)
        except OverflowError as exc:
            return _error(409, str(exc), code="residency_table_full")
        log.info("residency rule set", tenant=tenant, regions=",".join(sorted(regions)) if regions else "any")
        rule = listing(shared.current).get(tenant)
        return web.json_response({"object": "residency_rule", "tenant": tenant, "regions": rule})

    app.router.add_get("/admin/v1/residency", list_rules)
    app.router.add_put("/admin/v1/residency", set_rule)


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param=param, code=code), status=status)
