"""What a region's scheduler tells the global layer (`GET /summary?since=SEQ`), read about every
`regions.probe_interval_ms` over the WAN: small, so that reading it across a link costs little.

- `RegionLoad`: the region's load and its costs (from its cost profile), whole each time;
- `SessionDelta`: which sessions' KV the region holds, as changes since the reader's last `seq`
  (a bounded feed: a reader too far behind gets `reset` and the feed's whole retained content).

Sessions are named by `session_digest`, never by their ids: a summary crossing regions carries no
tenant's session names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

# An advisory the global layer sends to a region that lacks the session's KV, when moving the copy
# of another region beats recomputing it: "node-<i>:<tokens>", the node holding it and how much.
# The region's scheduler pulls it over its link to that node (only to a node of another region).
KV_SOURCE_HEADER = "X-Symphony-KV-Source"
MAX_DELTA_SESSIONS = 65_536  # entries one summary may carry (a feed retains at most this many)
_DIGEST_HEX = 16
MAX_NODE_NAME = 64


def session_digest(tenant: str, session_id: str) -> str:
    """A session's name in summaries: 64 bits of a hash of its tenant and id (length-prefixed, so
    no tenant/id split collides), as 16 hex digits."""
    name = tenant.encode()
    material = len(name).to_bytes(4, "big") + name + session_id.encode()
    return hashlib.blake2b(material, digest_size=_DIGEST_HEX // 2, person=b"symphony-session").hexdigest()


@dataclass(frozen=True, slots=True)
class RegionLoad:
    ready_nodes: int  # nodes whose engine serves
    idle_nodes: int  # ready nodes with no request waiting: a new request starts there at once
    running: int  # requests the engines run, summed over ready nodes
    waiting: int  # requests the engines hold waiting
    inflight: int  # requests the scheduler has sent and not seen end
    queued: int  # requests the scheduler holds back (selective pushing)
    kv_usage: float  # mean fraction of KV cache in use over ready nodes
    queue_ms: float = 0.0  # a new request's wait before its prefill, at the region's best node
    prefill_ms_per_token: float = 0.0  # the region's cost profile: per prompt token computed
    request_overhead_ms: float = 0.0  # ... per request, outside the engine
    kv_bytes_per_token: int = 0  # ... one token's KV (all layers, K and V)
    capacity: int = 0  # requests the ready nodes' engines run at once, summed (0: not known)
    # What KV the region holds costs per token, by the tiers its blocks sit in (its KV index's
    # sample, priced by its cost profile): loaded into the engine of the node holding it ...
    held_load_ms_per_token: float = 0.0
    # ... read out of that node for a pull by another region (the engine's copy read from the
    # node's store, as DRAM) ...
    held_read_ms_per_token: float = 0.0
    # ... and, for KV pulled here from another region, loaded from where a pull lands (DRAM).
    pulled_load_ms_per_token: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RegionLoad:
        """ValueError naming the field when `body` is not a summary. A field with a default may be
        missing (a scheduler of an earlier version, during an upgrade): it takes its default."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in body and f.default is not MISSING:
                continue
            value = body.get(f.name)
            kind = float if f.type == "float" else int
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise ValueError(f"summary field {f.name!r} is {value!r}, not a number >= 0")
            values[f.name] = kind(value)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class SessionDelta:
    epoch: str  # the feed's (a scheduler's run): a reader passes it back with `since`
    seq: int  # the feed's position after these changes: the reader's next `since`
    reset: bool  # the reader was too far behind: `held` is the whole feed, forget the rest
    # (session digest, tokens the region holds, 0: none any more; the node holding them, "" for 0)
    held: tuple[tuple[str, int, str], ...]

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seq": self.seq, "reset": self.reset, "held": [list(item) for item in self.held]}

    @classmethod
    def from_json(cls, body: Any) -> SessionDelta:
        """ValueError naming what is wrong."""
        if not isinstance(body, Mapping):
            raise ValueError("summary field 'sessions' is not an object")
        epoch, seq, reset, held = body.get("epoch"), body.get("seq"), body.get("reset"), body.get("held")
        if not isinstance(epoch, str) or not 0 < len(epoch) <= 64:
            raise ValueError(f"sessions.epoch is {epoch!r}, not a short string")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ValueError(f"sessions.seq is {seq!r}, not an integer >= 0")
        if not isinstance(reset, bool):
            raise ValueError(f"sessions.reset is {reset!r}, not true or false")
        if not isinstance(held, list) or len(held) > MAX_DELTA_SESSIONS:
            raise ValueError(f"sessions.held is not a list of at most {MAX_DELTA_SESSIONS} entries")
        items = []
        for item in held:
            if (
                not isinstance(item, list)
                or len(item) != 3
                or not isinstance(item[0], str)
                or len(item[0]) != _DIGEST_HEX
                or isinstance(item[1], bool)
                or not isinstance(item[1], int)
                or item[1] < 0
                or not isinstance(item[2], str)
                or len(item[2]) > MAX_NODE_NAME
            ):
                raise ValueError(f"sessions.held entry {item!r} is not [digest, tokens >= 0, node]")
            items.append((item[0], item[1], item[2]))
        return cls(epoch, seq, reset, tuple(items))


def format_kv_source(node: str, tokens: int) -> str:
    return f"{node}:{tokens}"


def parse_kv_source(value: str) -> tuple[str, int]:
    """(node, tokens) of a KV_SOURCE_HEADER value; ValueError saying what is wrong."""
    node, sep, tokens = value.strip().rpartition(":")
    if not sep or not node or len(node) > MAX_NODE_NAME or not tokens.isdigit() or int(tokens) < 1:
        raise ValueError(f'{KV_SOURCE_HEADER} must be "node:tokens" with tokens >= 1, got {value[:80]!r}')
    return node, int(tokens)
