"""Regions: which nodes each region holds, the WAN between every pair of regions, and the regions
each tenant's requests and KV may enter (data residency). Pure: parsed from the `[regions]`
configuration section, no I/O.

Nodes keep one global index across regions (node-<i>, ports base + i, as a one-region cluster
numbers them); the layout assigns them to regions in order: with `["us-east:1", "eu-west:2"]`,
node-0 is in us-east, node-1 and node-2 in eu-west.

Ports of a multi-region cluster on one host (`symphony up --regions`):
- region r's entry to the global layer: `scheduler.port + r` (the first region's is the one-region
  cluster's scheduler port, so a client of that region changes nothing);
- region r's regional scheduler: `regions.scheduler_port_base + r`;
- the WAN links' control API: `regions.link_port_base`; link listener k: `link_port_base + 1 + k`,
  in `link_plan`'s order.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from symphony.wan_link import LinkShape

# Typical public-cloud inter-region round trips (issue 37's matrix): us-east-eu-west 75 ms,
# us-east-ap-south 190 ms, eu-west-ap-south 120 ms, 1 Gb/s each.
DEFAULT_WAN_LINKS = (
    "us-east~eu-west:75:1000",
    "us-east~ap-south:190:1000",
    "eu-west~ap-south:120:1000",
)
MAX_REGIONS = 16
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    index: int  # position in the layout: its entry and scheduler ports are base + index
    nodes: tuple[int, ...]  # global node indices


@dataclass(frozen=True, slots=True)
class PlannedLink:
    """One listener of the WAN links process: traffic that starts in `source` and reaches `target`
    (a component of region `dest`: "scheduler" or "node-<i>") through the `source`~`dest` link."""

    source: str
    dest: str
    target: str
    port: int  # the listener's port; the target's port is the caller's to know


@dataclass(frozen=True)
class RegionTopology:
    regions: tuple[Region, ...]
    links: Mapping[frozenset[str], LinkShape]  # one per pair of distinct regions
    intra_rtt_ms: float
    residency: Mapping[str, frozenset[str]] = field(default_factory=dict)  # tenant -> allowed regions

    def region(self, name: str) -> Region:
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions)

    def region_of_node(self, index: int) -> str:
        for region in self.regions:
            if index in region.nodes:
                return region.name
        raise KeyError(index)

    def shape(self, a: str, b: str) -> LinkShape | None:
        """The WAN link between two regions; None within one."""
        return None if a == b else self.links[frozenset((a, b))]

    def rtt_ms(self, a: str, b: str) -> float:
        shape = self.shape(a, b)
        return self.intra_rtt_ms if shape is None else shape.rtt_ms

    def allowed(self, tenant: str, region: str) -> bool:
        """May `tenant`'s requests and KV enter `region`? A tenant with no rule may go anywhere."""
        rule = self.residency.get(tenant)
        return rule is None or region in rule

    def allowed_regions(self, tenant: str) -> tuple[str, ...]:
        return tuple(name for name in self.names if self.allowed(tenant, name))

    def link_plan(self, port_base: int) -> tuple[PlannedLink, ...]:
        """Every cross-region listener, numbered from `port_base + 1`: for each ordered pair of
        regions (a, b), the way from a to b's scheduler, then the ways from a to each of b's
        nodes (their gRPC: pulls of KV across regions)."""
        plan: list[PlannedLink] = []
        for a, b in itertools.permutations(self.names, 2):
            plan.append(PlannedLink(a, b, "scheduler", port_base + 1 + len(plan)))
        for a, b in itertools.permutations(self.names, 2):
            for node in self.region(b).nodes:
                plan.append(PlannedLink(a, b, node_name(node), port_base + 1 + len(plan)))
        return tuple(plan)


def node_name(index: int) -> str:
    """As SymphonyConfig.node_id names nodes."""
    return f"node-{index}"


def node_index(name: str) -> int | None:
    """The index of a node named "node-<i>"; None for any other name."""
    prefix, _, index = name.partition("-")
    return int(index) if prefix == "node" and index.isascii() and index.isdigit() else None


def parse_layout(entries: Sequence[str]) -> tuple[Region, ...]:
    """ "name:nodes" per region, in order; ValueError naming the bad entry."""
    regions: list[Region] = []
    next_node = 0
    for entry in entries:
        name, sep, count = entry.partition(":")
        if not sep or not _NAME.fullmatch(name) or not count.isdigit() or int(count) < 1:
            raise ValueError(
                f'{entry!r} is not "name:nodes" (a lowercase name of letters, digits and dashes, a colon, '
                "a node count of at least 1)"
            )
        if any(r.name == name for r in regions):
            raise ValueError(f"region {name!r} is given twice")
        regions.append(Region(name, len(regions), tuple(range(next_node, next_node + int(count)))))
        next_node += int(count)
    if len(regions) > MAX_REGIONS:
        raise ValueError(f"{len(regions)} regions; at most {MAX_REGIONS}")
    return tuple(regions)


def parse_link(entry: str) -> tuple[frozenset[str], LinkShape]:
    """ "a~b:rtt_ms:bandwidth_mbps[:jitter_ms[:loss]]"; ValueError naming what is wrong."""
    pair, *figures = entry.split(":")
    a, sep, b = pair.partition("~")
    if not sep or not _NAME.fullmatch(a) or not _NAME.fullmatch(b) or a == b or not 2 <= len(figures) <= 4:
        raise ValueError(f'{entry!r} is not "a~b:rtt_ms:bandwidth_mbps[:jitter_ms[:loss]]" for two regions')
    try:
        numbers = [float(f) for f in figures]
    except ValueError:
        raise ValueError(f"{entry!r}: the figures must be numbers") from None
    try:
        shape = LinkShape(*numbers)
    except ValueError as exc:
        raise ValueError(f"{entry!r}: {exc}") from None
    return frozenset((a, b)), shape


def parse_residency(entries: Iterable[str]) -> dict[str, frozenset[str]]:
    """ "tenant=region|region" per tenant; ValueError naming the bad entry."""
    rules: dict[str, frozenset[str]] = {}
    for entry in entries:
        tenant, sep, allowed = entry.partition("=")
        names = [n for n in allowed.split("|") if n]
        if not sep or not tenant or not names:
            raise ValueError(f'{entry!r} is not "tenant=region|region"')
        if tenant in rules:
            raise ValueError(f"tenant {tenant!r} is given twice")
        rules[tenant] = frozenset(names)
    return rules


def build_topology(
    layout: Sequence[str],
    links: Sequence[str],
    intra_rtt_ms: float,
    residency: Sequence[str],
    *,
    links_are_default: bool = False,
) -> RegionTopology:
    """The topology the `[regions]` keys describe; ValueError starting with the key at fault.
    Every pair of regions needs a link. A link naming a region outside the layout is refused,
    except among the defaults (a layout of other regions gives every link)."""

    def fail(key: str, message: str) -> ValueError:
        return ValueError(f"regions.{key}: {message}")

    try:
        regions = parse_layout(layout)
    except ValueError as exc:
        raise fail("layout", str(exc)) from None
    names = {r.name for r in regions}
    shapes: dict[frozenset[str], LinkShape] = {}
    for entry in links:
        try:
            pair, shape = parse_link(entry)
        except ValueError as exc:
            raise fail("links", str(exc)) from None
        if not pair <= names:
            if links_are_default:
                continue
            unknown = ", ".join(sorted(pair - names))
            raise fail("links", f"{entry!r} names a region not in regions.layout: {unknown}")
        if pair in shapes:
            raise fail("links", f"{' and '.join(sorted(pair))} are linked twice")
        shapes[pair] = shape
    for a, b in itertools.combinations([r.name for r in regions], 2):
        if frozenset((a, b)) not in shapes:
            raise fail("links", f'no link between {a} and {b}: add "{a}~{b}:rtt_ms:bandwidth_mbps"')
    if not 0 <= intra_rtt_ms < 1000:
        raise fail("intra_rtt_ms", f"{intra_rtt_ms} is not within [0, 1000)")
    try:
        rules = parse_residency(residency)
    except ValueError as exc:
        raise fail("residency", str(exc)) from None
    for tenant, allowed in rules.items():
        if not allowed <= names:
            unknown = ", ".join(sorted(allowed - names))
            raise fail("residency", f"tenant {tenant!r} is allowed a region not in regions.layout: {unknown}")
    return RegionTopology(regions, shapes, intra_rtt_ms, rules)
