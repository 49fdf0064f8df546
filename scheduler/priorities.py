"""Priority tiers set by an admin, per tenant or per session (a session's own setting wins).
Bounded: at most `max_entries` settings; setting a tier back to "normal" removes the entry."""

from __future__ import annotations

from collections import OrderedDict

from symphony.priority import PRIORITIES, Priority

DEFAULT = Priority.NORMAL


class PriorityTable:
    def __init__(self, max_entries: int) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._tenants: dict[str, Priority] = {}
        self._sessions: OrderedDict[tuple[str, str], Priority] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tenants) + len(self._sessions)

    def set(self, tenant: str, priority: str, session_id: str | None = None) -> None:
        """Raises ValueError for an unknown tier, OverflowError when the table is full."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
        tier = Priority(priority)
        table: dict = self._tenants if session_id is None else self._sessions
        key = tenant if session_id is None else (tenant, session_id)
        if tier == DEFAULT:
            table.pop(key, None)
            return
        if key not in table and len(self) >= self.max_entries:
            raise OverflowError(
                f"the priority table holds {self.max_entries} settings already; reset some to normal first"
            )
        table[key] = tier

    def of(self, tenant: str, session_id: str | None) -> Priority:
        if session_id is not None:
            tier = self._sessions.get((tenant, session_id))
            if tier is not None:
                return tier
        return self._tenants.get(tenant, DEFAULT)

    def entries(self) -> tuple[dict[str, Priority], list[tuple[str, str, Priority]]]:
        """(tenant -> tier, [(tenant, session, tier)]): every setting, sessions in the order set."""
        return dict(self._tenants), [(t, s, p) for (t, s), p in self._sessions.items()]

    def listing(self) -> dict[str, object]:
        return {
            "tenants": dict(self._tenants),
            "sessions": [{"tenant": t, "session_id": s, "priority": p} for (t, s), p in self._sessions.items()],
        }
