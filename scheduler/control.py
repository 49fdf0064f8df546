"""The scheduler's control state (`symphony.control_state`): what the admin API changed, restored
when the scheduler starts and saved after each change, so a restart keeps priority tiers, quota
changes and residency rules. Kept in `<home>/state/scheduler[-<region>].json`.

Contract: `restore` runs once, in `SchedulerState`'s constructor, before anything is served;
`save` runs after each admin change has been applied, one at a time (an asyncio lock), so the
file always ends with the latest state. A save that fails leaves the change applied in this
process only: the caller answers 503 saying so.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Protocol

from scheduler.errors import ApiError
from scheduler.metrics import SchedulerMetrics
from scheduler.priorities import PriorityTable
from symphony.config import SymphonyConfig
from symphony.control_state import ControlDocument, ControlStateError, ControlStore, SessionPriority
from symphony.logs import get_logger
from symphony.regions import RegionTopology
from symphony.residency_rules import RuleError, known_tenants, listing, parse_update, with_rule
from symphony.tenant_quotas import TenantQuotas

log = get_logger(__name__)


class SchedulerState(Protocol):
    """What the control state reads and restores of `scheduler.state.SchedulerState`."""

    config: SymphonyConfig
    metrics: SchedulerMetrics
    priorities: PriorityTable
    quotas: TenantQuotas
    topology: RegionTopology | None


def control_path(config: SymphonyConfig) -> Path:
    region = config.scheduler.region
    return config.home_path / "state" / (f"scheduler-{region}.json" if region else "scheduler.json")


class SchedulerControl:
    def __init__(self, store: ControlStore) -> None:
        self.store = store
        # The admin API's changes since the configuration: tenant -> its limits or rule (None: the
        # defaults, no rule). Bounded by the tenants with an API key.
        self.quota_changes: dict[str, dict[str, Any] | None] = {}
        self.residency_changes: dict[str, list[str] | None] = {}
        self._saving = asyncio.Lock()

    def restore(self, state: SchedulerState) -> None:
        """Apply the stored document to `state`. ControlStateError for one that cannot apply (a
        value out of range, a table overflowing, a rule naming an unknown region); a change for a
        tenant that no longer has an API key is dropped, with a warning (it could never apply)."""
        document = self.store.load()
        tenants = known_tenants(state.config.scheduler.api_keys)
        try:
            for tenant, priority in document.tenant_priorities.items():
                state.priorities.set(tenant, priority)
            for entry in document.session_priorities:
                state.priorities.set(entry.tenant, entry.priority, entry.session_id)
            for tenant, limits in document.quotas.items():
                if self._known(tenant, tenants, "quotas"):
                    state.quotas.set(tenant, limits)
                    self.quota_changes[tenant] = limits
            for tenant, regions in document.residency.items():
                if state.topology is None or not self._known(tenant, tenants, "residency"):
                    continue
                name, allowed = parse_update({"tenant": tenant, "regions": regions}, state.topology, tenants)
                state.topology = with_rule(state.topology, name, allowed)
                self.residency_changes[tenant] = regions
        except (ValueError, TypeError, OverflowError) as exc:  # RuleError is a ValueError
            where = f"{exc.param}: " if isinstance(exc, RuleError) else ""
            raise ControlStateError(f"{control_path(state.config)}: {where}{exc}") from None
        if not document.empty():
            log.info("admin changes restored", path=str(control_path(state.config)))

    @staticmethod
    def _known(tenant: str, tenants: frozenset[str], kind: str) -> bool:
        if tenant in tenants:
            return True
        log.warning("stored admin change dropped: the tenant has no API key", tenant=tenant, kind=kind)
        return False

    def snapshot(self, state: SchedulerState) -> ControlDocument:
        shown = state.priorities.listing()
        return ControlDocument(
            tenant_priorities=shown["tenants"],  # type: ignore[arg-type]
            session_priorities=[SessionPriority(**entry) for entry in shown["sessions"]],  # type: ignore[attr-defined]
            quotas=dict(self.quota_changes),
            residency=dict(self.residency_changes),
        )

    def quota_changed(self, state: SchedulerState, tenant: str, cleared: bool) -> None:
        self.quota_changes[tenant] = None if cleared else dataclasses.asdict(state.quotas.limits(tenant))

    def rule_changed(self, state: SchedulerState, tenant: str) -> None:
        assert state.topology is not None
        self.residency_changes[tenant] = listing(state.topology).get(tenant)

    async def save(self, state: SchedulerState) -> None:
        """Store the state as it is now. ApiError 503 when the store fails: the change holds in
        this process until it restarts."""
        async with self._saving:
            document = self.snapshot(state)
            try:
                await asyncio.to_thread(self.store.save, document)
            except OSError as exc:
                log.error("admin change not saved", error=repr(exc))
                state.metrics.control_save_failures.inc()
                raise ApiError(
                    503,
                    f"the change applies, but could not be saved ({exc.strerror or exc}): a restart will undo it",
                    code="state_not_saved",
                ) from None
