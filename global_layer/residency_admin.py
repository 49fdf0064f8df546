"""The global layer's residency admin API (`GET`/`PUT /admin/v1/residency` on any entry, bearer
`scheduler.admin_token`): every entry of the process reads one `SharedTopology`, so a rule set
through one entry holds at all of them from the next request on (symphony.residency_rules)."""

from __future__ import annotations

import json

from aiohttp import web

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
        return web.json_response(error_body(status, message, code=code), status=status)

    async def list_rules(request: web.Request) -> web.Response:
        if (answer := refused(request)) is not None:
            return answer
        return web.json_response({"object": "residency", "region": None, "rules": listing(shared.current)})

    async def set_rule(request: web.Request) -> web.Response:
        if (answer := refused(request)) is not None:
            return answer
        try:
            body = json.loads(await request.read())
            tenant, regions = parse_update(body, shared.current, tenants)
            shared.current = with_rule(shared.current, tenant, regions)
        except (ValueError, UnicodeDecodeError) as exc:  # RuleError, or a body that is no JSON
            param = exc.param if isinstance(exc, RuleError) else "body"
            message = str(exc) if isinstance(exc, RuleError) else "the body is not JSON"
            return web.json_response(error_body(400, message, param=param), status=400)
        except OverflowError as exc:
            return web.json_response(error_body(409, str(exc), code="residency_table_full"), status=409)
        log.info("residency rule set", tenant=tenant, regions=",".join(sorted(regions)) if regions else "any")
        rule = listing(shared.current).get(tenant)
        return web.json_response({"object": "residency_rule", "tenant": tenant, "regions": rule})

    app.router.add_get("/admin/v1/residency", list_rules)
    app.router.add_put("/admin/v1/residency", set_rule)
