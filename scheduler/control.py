"""The scheduler's control state (`symphony.control_state`): what the admin API changed, restored
when the scheduler starts and saved after each change, so a restart keeps priority tiers, quota
changes and residency rules. Kept in `<home>/state/scheduler[-<region>].json`.

Contract: `restore` runs once, in `SchedulerState`'s constructor, before anything is served;
`save` runs after each admin change has been applied, one at a time (an asyncio lock), so the
file always ends with the latest state. A save that fails leaves the change applied in this
process only: the caller answers 503 saying so. At restore, the configuration as it is now is the
baseline: a quota change applies the keys the admin set over it, and a residency rule whose
configuration changed since it was set gives way to the configuration (a warning says so).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from scheduler.errors import ApiError
from scheduler.metrics import SchedulerMetrics
from scheduler.priorities import PriorityTable
from symphony.config import SymphonyConfig
from symphony.control_etcd import TenantEntry
from symphony.control_state import (
    Changed,
    ControlDocument,
    ControlStateError,
    ControlStore,
    QuotaChange,
    RuleChange,
    SessionPriority,
    with_kept_rule,
)
from symphony.logs import get_logger
from symphony.regions import RegionTopology
from symphony.residency_rules import RuleError, known_tenants, listing, parse_update, with_rule
from symphony.tenant_quotas import TenantLimits, TenantQuotas

log = get_logger(__name__)


class Controlled(Protocol):
    """What the control state reads and restores of `scheduler.state.SchedulerState`."""

    config: SymphonyConfig
    metrics: SchedulerMetrics
    priorities: PriorityTable
    quotas: TenantQuotas
    topology: RegionTopology | None


def control_path(config: SymphonyConfig) -> Path:
    region = config.scheduler.region
    return config.home_path / "state" / (f"scheduler-{region}.json" if region else "scheduler.json")


class WriteOrder(Protocol):
    def writing(self, changed: Changed) -> None: ...

    def written(self, changed: Changed, revision: int) -> None: ...


class SchedulerControl:
    def __init__(self, store: ControlStore) -> None:
        self.store = store
        # The admin API's changes since the configuration, per tenant. Bounded by the tenants with
        # an API key (a change for another is refused by the API and dropped at restore).
        self.quota_changes: dict[str, QuotaChange] = {}
        self.residency_changes: dict[str, RuleChange] = {}
        # The configuration's residency rules, read at restore before any change applies: what a
        # change is recorded over, and what a later start compares with.
        self.configured_rules: dict[str, list[str]] = {}
        self.baseline_quotas: dict[str, TenantLimits] = {}  # the configuration's tenant overrides
        self._saving = asyncio.Lock()
        # With replicas (scheduler.control_watch): told of each write, so that another replica's
        # change is applied in etcd's order with this one's.
        self.writes: WriteOrder | None = None

    def restore(self, state: Controlled) -> None:
        """Apply the stored document to `state`. ControlStateError for one that cannot apply (a
        value out of range, a rule naming a region not in the layout). Dropped with a warning: a
        change for a tenant that no longer has an API key (it could never apply), a residency rule
        whose configuration changed since, and tiers past `scheduler.max_priority_settings`."""
        document = self.store.load()
        path = self.store.where
        tenants = known_tenants(state.config.scheduler.api_keys)
        self.baseline_quotas = dict(state.quotas.overrides)  # the configuration's, before any change
        try:
            self._restore_priorities(state, document, tenants)
            for tenant, change in document.quotas.items():
                if self._known(tenant, tenants, "quotas"):
                    if change.cleared:
                        state.quotas.set(tenant, None)
                    if change.limits:
                        state.quotas.set(tenant, change.limits)
                    self.quota_changes[tenant] = change
            if state.topology is not None:
                self.configured_rules = configured = listing(state.topology)  # none applied yet
                for tenant, rule in document.residency.items():
                    if not self._known(tenant, tenants, "residency"):
                        continue
                    kept = with_kept_rule(state.topology, tenant, rule, configured, tenants)
                    if kept is not None:
                        state.topology = kept
                        self.residency_changes[tenant] = rule
        except (ValueError, TypeError, OverflowError) as exc:  # RuleError is a ValueError
            where = f"{exc.param}: " if isinstance(exc, RuleError) else ""
            raise ControlStateError(f"{path}: {where}{exc}") from None
        if not document.empty():
            log.info("admin changes restored", source=path)

    def _restore_priorities(self, state: Controlled, document: ControlDocument, tenants: frozenset[str]) -> None:
        settings: list[tuple[str, str | None, str]] = [
            (tenant, None, tier) for tenant, tier in document.tenant_priorities.items()
        ]
        settings += [(entry.tenant, entry.session_id, entry.priority) for entry in document.session_priorities]
        for tenant, session_id, tier in settings:
            if not self._known(tenant, tenants, "priority"):
                continue
            try:
                state.priorities.set(tenant, tier, session_id)
            except OverflowError:
                log.warning(
                    "stored priority tiers past scheduler.max_priority_settings dropped", kept=len(state.priorities)
                )
                return

    def apply(self, state: Controlled, changed: Changed, entry: TenantEntry | SessionPriority | None) -> None:
        """A change stored by a replica (this one's own, back from the store, changes nothing):
        `entry` is the tenant's or session's entry now (None: back to the configuration). It
        applies over the configuration as at restore, with the same drops (logged)."""
        tenant = changed.tenant
        if not self._known(tenant, known_tenants(state.config.scheduler.api_keys), "change"):
            return
        if changed.session_id is not None:
            tier = entry.priority if isinstance(entry, SessionPriority) else "normal"
            self._set_tier(state, tenant, tier, changed.session_id)
            return
        entry = entry if isinstance(entry, TenantEntry) else TenantEntry()
        self._set_tier(state, tenant, entry.priority or "normal", None)
        base = self.baseline_quotas.get(tenant)
        state.quotas.overrides.pop(tenant, None)
        if base is not None:
            state.quotas.overrides[tenant] = base
        self.quota_changes.pop(tenant, None)
        if entry.quota is not None:
            try:
                if entry.quota.cleared:
                    state.quotas.set(tenant, None)
                if entry.quota.limits:
                    state.quotas.set(tenant, entry.quota.limits)
                self.quota_changes[tenant] = entry.quota
            except (ValueError, TypeError) as exc:
                log.warning("stored quota change dropped", tenant=tenant, error=str(exc))
        if state.topology is not None:
            self._apply_rule(state, tenant, entry.residency)

    def _apply_rule(self, state: Controlled, tenant: str, rule: RuleChange | None) -> None:
        """`tenant`'s rule as `rule` sets it over the configuration; None (or a rule dropped):
        the configuration's."""
        assert state.topology is not None
        tenants = known_tenants(state.config.scheduler.api_keys)
        try:
            kept = (
                None if rule is None else with_kept_rule(state.topology, tenant, rule, self.configured_rules, tenants)
            )
            if kept is None:
                body = {"tenant": tenant, "regions": self.configured_rules.get(tenant)}
                name, allowed = parse_update(body, state.topology, tenants)
                kept, rule = with_rule(state.topology, name, allowed), None
        except (RuleError, OverflowError) as exc:
            log.warning("stored residency rule dropped", tenant=tenant, error=str(exc))
            return
        state.topology = kept
        if rule is None:
            self.residency_changes.pop(tenant, None)
        else:
            self.residency_changes[tenant] = rule

    @staticmethod
    def _set_tier(state: Controlled, tenant: str, tier: str, session_id: str | None) -> None:
        try:
            state.priorities.set(tenant, tier, session_id)
        except OverflowError:
            log.warning("stored priority tier dropped: past scheduler.max_priority_settings", tenant=tenant)

    @staticmethod
    def _known(tenant: str, tenants: frozenset[str], kind: str) -> bool:
        if tenant in tenants:
            return True
        log.warning("stored admin change dropped: the tenant has no API key", tenant=tenant, kind=kind)
        return False

    def snapshot(self, state: Controlled) -> ControlDocument:
        tenant_tiers, session_tiers = state.priorities.entries()
        return ControlDocument(
            tenant_priorities={tenant: tier.value for tenant, tier in tenant_tiers.items()},  # type: ignore[misc]
            session_priorities=[SessionPriority(tenant=t, session_id=s, priority=p.value) for t, s, p in session_tiers],  # type: ignore[arg-type]
            quotas=dict(self.quota_changes),
            residency=dict(self.residency_changes),
        )

    def quota_changed(self, tenant: str, changes: Mapping[str, int | float] | None) -> None:
        """Record an applied quota update (None: cleared back to the defaults)."""
        if changes is None:
            self.quota_changes[tenant] = QuotaChange(cleared=True)
            return
        change = self.quota_changes.get(tenant, QuotaChange())
        self.quota_changes[tenant] = QuotaChange(cleared=change.cleared, limits={**change.limits, **changes})

    def rule_changed(self, state: Controlled, tenant: str) -> None:
        """Record an applied residency rule, over the configuration's rule for the tenant."""
        assert state.topology is not None
        self.residency_changes[tenant] = RuleChange(
            regions=listing(state.topology).get(tenant), config=self.configured_rules.get(tenant)
        )

    async def save(self, state: Controlled, changed: Changed) -> None:
        """Store the state as it is now, after the change `changed`. ApiError 503 when the store
        fails: the change holds in this process, and is lost if it restarts before a later change
        is saved (or, with replicas, the others do not see it)."""
        writes = self.writes
        if writes is not None:  # before any await: a change arriving meanwhile waits for this write
            writes.writing(changed)
        revision = 0
        try:
            async with self._saving:
                document = self.snapshot(state)
                written = await asyncio.to_thread(self.store.save, document, changed)
                revision = written or 0
        except OSError as exc:
            log.error("admin change not saved", error=repr(exc))
            state.metrics.control_save_failures.inc()
            raise ApiError(
                503,
                f"the change applies here but could not be saved ({exc.strerror or exc}): it is lost if the "
                "scheduler restarts before another change is saved",
                code="state_not_saved",
            ) from None
        finally:
            if writes is not None:
                writes.written(changed, revision)
