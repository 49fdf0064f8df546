"""Per-tenant quotas, so that one tenant cannot take what the others need (`[quotas]`).

Each tenant has, by default or by its own override:
- token buckets for requests and for advisories: `*_per_s` tokens a second, up to `*_burst` held
  (a tenant idle for a while may send a burst that large at once). A request finding its bucket
  empty is refused (429, with the seconds until a token comes back as Retry-After);
- a cap on its requests in flight, from the moment one is admitted to the end of its answer
  (streamed or whole);
- a cap on its requests held back by selective pushing, and its weight in that queue
  (`scheduler.held_queue`: tenants take turns by weight within a priority tier).
0 turns a limit off: the scheduler's own bounds (`scheduler.max_inflight_requests`,
`scheduler.max_queued_requests`) still hold.

Pure: callers pass the time (monotonic seconds); no I/O. Not thread-safe (the scheduler's event
loop is its only user). Bounded by the tenants there are: a request's tenant comes from its API key
(`scheduler.api_keys`; one tenant without keys), so there are two buckets per configured tenant at
most, and in-flight counts only for tenants with requests in flight. Each scheduler process keeps
its own: with several regional schedulers a tenant has a bucket in each region it uses.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from symphony.config_schema import QuotasConfig

__all__ = [
    "LIMIT_KEYS",
    "QuotaKind",
    "TenantLimits",
    "TenantQuotas",
    "TokenBucket",
    "parse_overrides",
    "quotas_from_config",
]

QuotaKind = Literal["requests", "advisories"]
# Rates a bucket may have (per second; 0: none): the slowest refills in under 17 minutes, so the
# longest Retry-After is that. Weights a tenant may have: fair queueing's tags grow by 1 / weight per
# request, and must stay far from float precision's limits.
MIN_RATE_PER_S, MAX_RATE_PER_S = 0.001, 1e6
MIN_WEIGHT, MAX_WEIGHT = 0.001, 1000.0
MAX_COUNT = 10**9  # bursts and caps: past any real need, and within a float's exact integers


@dataclass(frozen=True)
class TenantLimits:
    requests_per_s: float = 0.0  # 0: no rate limit
    request_burst: int = 0  # 0: the rate rounded up (at least 1)
    advisories_per_s: float = 0.0
    advisory_burst: int = 0
    max_inflight: int = 0  # 0: only scheduler.max_inflight_requests
    max_queued: int = 0  # 0: only scheduler.max_queued_requests
    weight: float = 1.0  # share of the hold-back queue within a priority tier (> 0)

    def rate(self, kind: QuotaKind) -> tuple[float, float]:
        """(tokens per second, bucket size) of `kind`; a rate of 0 is no limit."""
        rate, burst = (
            (self.requests_per_s, self.request_burst)
            if kind == "requests"
            else (self.advisories_per_s, self.advisory_burst)
        )
        return rate, float(burst or max(1, math.ceil(rate)))

    def error(self) -> str | None:
        """What is out of range, as "key: message"; None when every value is."""
        for key in ("requests_per_s", "advisories_per_s"):
            value = getattr(self, key)
            if not (value == 0 or MIN_RATE_PER_S <= value <= MAX_RATE_PER_S):
                return f"{key}: must be 0 (no limit) or in {MIN_RATE_PER_S:g}..{MAX_RATE_PER_S:g}, got {value}"
        for key in ("request_burst", "advisory_burst", "max_inflight", "max_queued"):
            if not 0 <= getattr(self, key) <= MAX_COUNT:
                return f"{key}: must be 0 (no limit) or up to {MAX_COUNT:.0e}, got {getattr(self, key)}"
        if not MIN_WEIGHT <= self.weight <= MAX_WEIGHT:
            return f"weight: must be in {MIN_WEIGHT:g}..{MAX_WEIGHT:g}, got {self.weight}"
        return None


LIMIT_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TenantLimits))
_INT_KEYS = frozenset(f.name for f in dataclasses.fields(TenantLimits) if f.type == "int")


def parse_overrides(entries: Iterable[str], default: TenantLimits) -> dict[str, TenantLimits]:
    """`"tenant:key=value,key=value"` entries as each tenant's limits (`default`'s where an entry is
    silent). ValueError naming the entry and what is wrong with it."""
    overrides: dict[str, TenantLimits] = {}
    for entry in entries:
        tenant, sep, settings = entry.partition(":")
        if not (sep and tenant and settings):
            raise ValueError(f'{entry!r} is not "tenant:key=value,..."')
        if tenant in overrides:
            raise ValueError(f"tenant {tenant!r} is given twice")
        values: dict[str, float | int] = {}
        for setting in settings.split(","):
            key, eq, text = setting.strip().partition("=")
            if key not in LIMIT_KEYS or not eq:
                raise ValueError(
                    f"{entry!r}: {setting.strip()!r} is not key=value with a key of {', '.join(LIMIT_KEYS)}"
                )
            if key in values:
                raise ValueError(f"{entry!r}: {key} is given twice")
            try:
                values[key] = int(text) if key in _INT_KEYS else float(text)
            except ValueError:
                kind = "a whole number" if key in _INT_KEYS else "a number"
                raise ValueError(f"{entry!r}: {key} must be {kind}, got {text!r}") from None
        limits = dataclasses.replace(default, **values)  # type: ignore[arg-type]
        if (problem := limits.error()) is not None:
            raise ValueError(f"{entry!r}: {problem}")
        overrides[tenant] = limits
    return overrides


@dataclass(slots=True)
class TokenBucket:
    tokens: float
    updated_s: float

    def take(self, rate: float, burst: float, now_s: float) -> float:
        """Take one token: 0.0 when taken, else the seconds until one is there (none taken)."""
        self.tokens = min(burst, self.tokens + max(0.0, now_s - self.updated_s) * rate)
        self.updated_s = max(self.updated_s, now_s)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate


class TenantQuotas:
    def __init__(self, default: TenantLimits, overrides: Mapping[str, TenantLimits] | None = None) -> None:
        for limits in (default, *(overrides or {}).values()):
            if (problem := limits.error()) is not None:
                raise ValueError(problem)
        self.default = default
        self.overrides = dict(overrides or {})
        self._buckets: dict[tuple[QuotaKind, str], TokenBucket] = {}
        self._inflight: Counter[str] = Counter()

    def limits(self, tenant: str) -> TenantLimits:
        return self.overrides.get(tenant, self.default)

    def set(self, tenant: str, changes: Mapping[str, float | int] | None) -> TenantLimits:
        """The admin API's update: `changes` (LIMIT_KEYS) over the tenant's limits now, or, for
        None, back to the defaults. ValueError as "key: message" for a value out of range (nothing
        changed). Its buckets keep their tokens: a new rate or burst applies from its next request."""
        if changes is None:
            self.overrides.pop(tenant, None)
            return self.default
        limits = dataclasses.replace(self.limits(tenant), **changes)  # type: ignore[arg-type]
        if (problem := limits.error()) is not None:
            raise ValueError(problem)
        self.overrides[tenant] = limits
        return limits

    def listing(self) -> dict[str, object]:
        """The defaults and every tenant's own limits, as the admin API shows them."""
        return {
            "default": dataclasses.asdict(self.default),
            "tenants": {tenant: dataclasses.asdict(limits) for tenant, limits in sorted(self.overrides.items())},
        }

    def take(self, kind: QuotaKind, tenant: str, now_s: float) -> float:
        """One `kind` token of the tenant's bucket: 0.0 when admitted, else the seconds to wait."""
        rate, burst = self.limits(tenant).rate(kind)
        if rate <= 0:
            return 0.0
        key = (kind, tenant)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(burst, now_s)
        return bucket.take(rate, burst, now_s)

    def inflight(self, tenant: str) -> int:
        return self._inflight[tenant]

    def enter(self, tenant: str) -> bool:
        """Count one more request of the tenant in flight; False (nothing counted) at its cap."""
        cap = self.limits(tenant).max_inflight
        if cap and self._inflight[tenant] >= cap:
            return False
        self._inflight[tenant] += 1
        return True

    def leave(self, tenant: str) -> None:
        """One of the tenant's requests `enter` counted has ended."""
        self._inflight[tenant] -= 1
        if self._inflight[tenant] <= 0:
            del self._inflight[tenant]


def quotas_from_config(config: QuotasConfig, tenants: frozenset[str]) -> TenantQuotas:
    """The quotas `[quotas]` sets, for a scheduler serving `tenants` (those with an API key, or the
    default tenant). ValueError as "key: message" for a value out of range or an override of a
    tenant that does not exist (it would never apply)."""
    default = TenantLimits(**{key: getattr(config, key) for key in LIMIT_KEYS})
    if (problem := default.error()) is not None:
        raise ValueError(problem)
    try:
        overrides = parse_overrides(config.tenants, default)
    except ValueError as exc:
        raise ValueError(f"tenants: {exc}") from None
    for tenant in overrides:
        if tenant not in tenants:
            raise ValueError(
                f"tenants: tenant {tenant!r} has no API key (scheduler.api_keys names {', '.join(sorted(tenants))}): "
                "its limits would never apply"
            )
    return TenantQuotas(default, overrides)
