"""A region's load as its scheduler reports it (`GET /summary`) and the global layer reads it about
every `regions.probe_interval_ms`: small, so that reading it over a WAN link costs little."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class RegionLoad:
    ready_nodes: int  # nodes whose engine serves
    idle_nodes: int  # ready nodes with no request waiting: a new request starts there at once
    running: int  # requests the engines run, summed over ready nodes
    waiting: int  # requests the engines hold waiting
    inflight: int  # requests the scheduler has sent and not seen end
    queued: int  # requests the scheduler holds back (selective pushing)
    kv_usage: float  # mean fraction of KV cache in use over ready nodes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RegionLoad:
        """ValueError naming the field when `body` is not a summary."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = body.get(f.name)
            kind = float if f.type == "float" else int
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"summary field {f.name!r} is {value!r}, not a number >= 0")
            values[f.name] = kind(value)
        return cls(**values)
