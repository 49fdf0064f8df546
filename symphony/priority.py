"""Priority tiers, defined once: the names clients and admins use, their rank, and the wire value.

The scheduler works with `Priority` (a `StrEnum`, so a member equals its name: `"high"`), the
node's store with its own `IntEnum` of the same ranks (`node_manager.kv.pages.Priority.of`), and
the gRPC API with `symphony.v1.Priority`. The mappings here are the only place those meet.
"""

from __future__ import annotations

from enum import StrEnum

from symphony.rpc import kv_pb2


class Priority(StrEnum):
    """A session's or tenant's tier, lowest first; a higher tier is served and kept first."""

    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"

    @property
    def rank(self) -> int:
        """0 for LOW, rising with the tier."""
        return _RANK[self]

    @property
    def proto(self) -> kv_pb2.Priority:
        """The `symphony.v1.Priority` value."""
        return _TO_PROTO[self]

    @classmethod
    def parse(cls, text: str) -> Priority:
        """The tier named `text` (any case); ValueError naming the tiers otherwise."""
        try:
            return cls(text.lower())
        except (ValueError, AttributeError):
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {text!r}") from None

    @classmethod
    def from_proto(cls, value: int) -> Priority | None:
        """The tier of a `symphony.v1.Priority` value; None for UNSPECIFIED or an unknown value."""
        return _FROM_PROTO.get(value)


PRIORITIES: tuple[Priority, ...] = tuple(Priority)  # in rank order
_RANK = {p: rank for rank, p in enumerate(PRIORITIES)}
_TO_PROTO: dict[Priority, kv_pb2.Priority] = {
    Priority.LOW: kv_pb2.PRIORITY_LOW,
    Priority.NORMAL: kv_pb2.PRIORITY_NORMAL,
    Priority.HIGH: kv_pb2.PRIORITY_HIGH,
}
_FROM_PROTO: dict[int, Priority] = {v: k for k, v in _TO_PROTO.items()}
