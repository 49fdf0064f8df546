"""The global layer's residency admin API (`GET`/`PUT /admin/v1/residency` on any entry, bearer
`scheduler.admin_token`): every entry of the process reads one `SharedTopology`, so a rule set
through one entry holds at all of them from the next request on (symphony.residency_rules).

The rules the API set are kept in `<home>/state/global.json` (symphony.control_state, the
document's `residency` part), restored at start over the configuration as a regional scheduler's
are (scheduler.control): a rule whose configuration changed since it was set gives way to the
configuration, and a file that cannot be used stops the global layer from starting. A rule that
cannot be saved applies in this process only: 503 `state_not_saved`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import PayloadEncodingError
from aiohttp.web_protocol import RequestPayloadError

from symphony.api_errors import error_body
from symphony.config import SymphonyConfig
from symphony.control_state import (
    Changed,
    ControlDocument,
    ControlStateError,
    ControlStore,
    RuleChange,
    with_kept_rule,
)
from symphony.logs import get_logger
from symphony.regions import RegionTopology
from symphony.residency_rules import RuleError, known_tenants, listing, parse_update, with_rule
from symphony.tenancy import admin_refusal

log = get_logger(__name__)


def global_state_path(config: SymphonyConfig) -> Path:
    return config.home_path / "state" / "global.json"


class SharedTopology:
    """The regions and residency rules the entries route by; `current` is replaced whole (one
    assignment on the event loop), never changed in place. With a `store`, the rules the admin
    API set are restored from it (`restore`) and saved to it after each change (`save`)."""

    def __init__(self, topology: RegionTopology, store: ControlStore | None = None) -> None:
        self.current = topology
        self.store = store
        self.configured = listing(topology)  # the configuration's rules: what a change is set over
        self.changes: dict[str, RuleChange] = {}  # tenant -> its rule as the admin API set it
        self._saving = asyncio.Lock()

    def restore(self, tenants: frozenset[str]) -> None:
        """Apply the stored rules. ControlStateError for a store that cannot be used or a rule that
        cannot apply (a region not in the layout)."""
        if self.store is None:
            return
        document = self.store.load()
        for tenant, rule in document.residency.items():
            if tenant not in tenants:
                log.warning("stored residency rule dropped: the tenant has no API key", tenant=tenant)
                continue
            try:
                kept = with_kept_rule(self.current, tenant, rule, self.configured, tenants)
            except (RuleError, OverflowError) as exc:
                raise ControlStateError(f"{self.store.where}: {exc}") from None
            if kept is not None:
                self.current = kept
                self.changes[tenant] = rule
        if self.changes:
            log.info("residency rules restored", source=self.store.where, tenants=len(self.changes))

    async def save(self, tenant: str) -> None:
        """Keep `tenant`'s rule as it is now. OSError when it cannot be saved."""
        if self.store is None:
            return
        self.changes[tenant] = RuleChange(regions=listing(self.current).get(tenant), config=self.configured.get(tenant))
        async with self._saving:
            document = ControlDocument(residency=dict(self.changes))
            await asyncio.to_thread(self.store.save, document, Changed(tenant))


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
        try:
            await shared.save(tenant)
        except OSError as exc:
            log.error("residency rule not saved", error=repr(exc))
            return _error(
                503,
                f"the rule applies here but could not be saved ({exc.strerror or exc}): it is lost if the "
                "global layer restarts before another change is saved",
                code="state_not_saved",
            )
        rule = listing(shared.current).get(tenant)
        return web.json_response({"object": "residency_rule", "tenant": tenant, "regions": rule})

    app.router.add_get("/admin/v1/residency", list_rules)
    app.router.add_put("/admin/v1/residency", set_rule)


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param=param, code=code), status=status)
