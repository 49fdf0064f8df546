"""Changing a tenant's residency rule while the regions run (`PUT /admin/v1/residency` on every
regional scheduler and on the global layer, `symphony admin residency`).

A rule set through the admin API replaces the configuration's (`regions.residency`) for that
tenant until the process restarts; the configuration stays the durable source. Each process holds
its rules in its `RegionTopology`, replaced whole on a change (`with_rule`), so a request sees
either the old rules or the new ones, never a mix. Pure: parsing and replacing, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from symphony.regions import RegionTopology
from symphony.tenancy import DEFAULT_TENANT, tenant_name_error

MAX_RESIDENCY_RULES = 4096  # tenants with a rule, per process


class RuleError(ValueError):
    """A bad update: `param` names the field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def known_tenants(api_keys: Iterable[str]) -> frozenset[str]:
    """The tenants a rule may name: those with an API key (`scheduler.api_keys`), or the default
    tenant when there are none."""
    return frozenset(entry.partition(":")[0] for entry in api_keys) or frozenset({DEFAULT_TENANT})


def parse_update(body: Any, topology: RegionTopology, tenants: frozenset[str]) -> tuple[str, frozenset[str] | None]:
    """`{"tenant": T, "regions": [R, ...] | null}` as (tenant, allowed regions; None: the rule is
    removed and the tenant may use every region). RuleError naming the field otherwise."""
    if not isinstance(body, Mapping):
        raise RuleError("body", "expected a JSON object")
    unknown_keys = sorted(set(body) - {"tenant", "regions"})
    if unknown_keys:
        raise RuleError(unknown_keys[0], f"unknown field {unknown_keys[0]!r} (fields: tenant, regions)")
    tenant = body.get("tenant")
    if (invalid := tenant_name_error(tenant)) is not None:
        raise RuleError("tenant", invalid)
    assert isinstance(tenant, str)
    if tenant not in tenants:
        raise RuleError("tenant", f"tenant {tenant!r} has no API key (known: {', '.join(sorted(tenants))})")
    if "regions" not in body:  # never read as "remove the rule": that takes an explicit null
        raise RuleError("regions", "regions is required: a list of region names, or null to remove the rule")
    regions = body["regions"]
    if regions is None:
        return tenant, None
    if not isinstance(regions, list) or not regions or not all(isinstance(r, str) for r in regions):
        raise RuleError("regions", "regions must be a non-empty list of region names, or null to remove the rule")
    if len(set(regions)) != len(regions):
        raise RuleError("regions", "regions names a region twice")
    unknown = [r for r in regions if r not in topology.names]
    if unknown:
        raise RuleError(
            "regions", f"unknown region {', '.join(map(repr, unknown))} (regions: {', '.join(topology.names)})"
        )
    return tenant, frozenset(regions)


def with_rule(topology: RegionTopology, tenant: str, regions: frozenset[str] | None) -> RegionTopology:
    """`topology` with `tenant`'s rule replaced (None: removed). OverflowError when a new rule would
    pass MAX_RESIDENCY_RULES."""
    rules = dict(topology.residency)
    if regions is None:
        rules.pop(tenant, None)
    else:
        if tenant not in rules and len(rules) >= MAX_RESIDENCY_RULES:
            raise OverflowError(f"{MAX_RESIDENCY_RULES} tenants have a residency rule already")
        rules[tenant] = regions
    return dataclasses.replace(topology, residency=rules)


def listing(topology: RegionTopology) -> dict[str, list[str]]:
    """Every rule, tenant -> allowed regions in layout order."""
    return {
        tenant: [name for name in topology.names if name in allowed]
        for tenant, allowed in sorted(topology.residency.items())
    }
