"""What the global layer's policies decide from: a request as the entry sees it, and each region as
the entry last read it. Plain values (global_layer.policies decide, global_layer.costs price)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from symphony.region_load import RegionLoad
from symphony.regions import RegionTopology


@dataclass(frozen=True, slots=True)
class RegionView:
    """What an entry knows of one region: whether its scheduler answered lately, and its load."""

    name: str
    up: bool
    load: RegionLoad | None  # None until the first summary arrived


@dataclass(frozen=True, slots=True)
class RegionRequest:
    tenant: str
    client_region: str  # where the client is (X-Client-Region, else the entry it called)
    session: str | None = None  # the session's digest (symphony.region_load.session_digest)
    text: str = ""  # the prompt's leading text, for prefix-matching policies
    prompt_tokens: int = 0  # the entry's estimate of the whole prompt (it does not tokenize)
    held: Mapping[str, int] = field(default_factory=dict)  # region -> tokens of the session's KV held there
    holders: Mapping[str, str] = field(default_factory=dict)  # region -> the node holding them
    advisory: bool = False  # an advisory: its request is still to come, KV may move before it


class RegionPolicy(Protocol):
    """Orders the candidate regions (up, allowed to the tenant) best first; the entry tries them in
    that order, so the rest of the list is the failover order. `observe`: the request went there.
    Pure but for what `observe` teaches it (no I/O, no clocks)."""

    name: str
    needs_body: bool  # decides on the request's session and text (the entry parses the body)
    moves_kv: bool  # an advisory may move a session's KV from another region to the one chosen

    def rank(self, request: RegionRequest, candidates: Sequence[RegionView], topology: RegionTopology) -> list[str]: ...

    def observe(self, request: RegionRequest, region: str) -> None: ...

    def move_source(
        self, request: RegionRequest, region: str, candidates: Sequence[RegionView], topology: RegionTopology
    ) -> tuple[str, int] | None:
        """For an advisory sent to `region`: the copy of another region to pull first, as (node,
        tokens); None: nothing to move."""
        ...
