"""What serving a request in a region costs, as the global layer's `symphony` and `gorgo` policies
price it. Pure: from the request, the regions' summaries (symphony.region_load) and the topology.

A request served in region r, for a client in region c, whose session region r holds `held_r`
tokens of (its best node's copy) and other regions more:
- `rtt_ms`: the round trip between c and r (the request goes, its first token comes back);
- `queue_ms`: r's wait before a new request's prefill (its scheduler prices it at its best node);
- `overhead_ms`: r's per-request cost outside the engine;
- `load_ms`: loading r's copy into the engine of its node, from the tiers it sits in
  (`RegionLoad.held_load_ms_per_token`: r's KV index says where its blocks sit, its cost profile
  what each tier costs);
- `prefill_ms`: computing what r lacks, or, when `can_move` and cheaper, moving the longer copy of
  another region s and computing only what no region holds. `move_ms` then says what the move
  takes: reading the extra tokens out of s's node (s's `held_read_ms_per_token`, or r's when s has
  sent no summary), the s~r link (its round trip, then the bytes at its bandwidth), and loading
  them from where a pull lands in r (`pulled_load_ms_per_token`), as the regional `symphony`
  policy prices a pull between two nodes.

The computing part of `prefill_ms` is priced by r's fill u (`fill`: the share of the requests its
engines can run at once that are taken, with those its scheduler holds back), as a queue's wait
grows with its utilization, by 1 / (1 - u); so is `queue_ms` for a request that starts a session:
- the prefill a request computes in r delays every request r runs: computing a session's history
  again in a filling region costs the region's other requests, not only this one;
- a request that starts a session (it names one, and no region holds any of it) settles it: its
  later turns follow its KV. Its wait is priced for the session's life, `queue_ms` / (1 - u), so
  new sessions go to the regions with room while a hot region still has some, and the sessions it
  holds stay home.
Without a capacity (`RegionLoad.capacity` 0) the fill is 0 and nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from global_layer.views import RegionRequest, RegionView
from symphony.region_load import RegionLoad
from symphony.regions import RegionTopology

_BYTES_PER_MS_PER_MBPS = 1e6 / 8 / 1000  # one Mb/s moves this many bytes a millisecond
MAX_FILL = 0.99  # a full region (or one past full, by the requests held back) costs 100x, not infinity


@dataclass(frozen=True, slots=True)
class RegionCost:
    rtt_ms: float
    queue_ms: float
    overhead_ms: float
    prefill_ms: float
    move_ms: float = 0.0  # a move of KV from `source` over the WAN, before the prefill
    source: str | None = None  # the region KV is moved from (None: none is)
    fill: float = 0.0  # the region's (`fill`), which `prefill_ms` (and a new session's `queue_ms`) is priced by
    load_ms: float = 0.0  # loading the region's own copy from its tiers

    @property
    def total_ms(self) -> float:
        return self.rtt_ms + self.queue_ms + self.overhead_ms + self.load_ms + self.prefill_ms + self.move_ms


def prompt_tokens(request: RegionRequest) -> int:
    """The prompt's tokens: the entry's estimate, but never fewer than a held copy plus one."""
    longest = max(request.held.values(), default=0)
    return max(request.prompt_tokens, longest + 1)


def fill(load: RegionLoad) -> float:
    """The share of what a region's engines can run at once that its requests take, those its
    scheduler holds back counted too, at most `MAX_FILL`; 0 without a capacity."""
    if load.capacity <= 0:
        return 0.0
    taken = max(load.running + load.waiting, load.inflight) + load.queued
    return min(MAX_FILL, taken / load.capacity)


def move_ms(topology: RegionTopology, source: str, dest: str, tokens: int, kv_bytes_per_token: int) -> float:
    """Moving `tokens` of KV from region `source` to `dest` over their link."""
    shape = topology.shape(source, dest)
    if shape is None:
        return 0.0
    return shape.rtt_ms + tokens * kv_bytes_per_token / (shape.bandwidth_mbps * _BYTES_PER_MS_PER_MBPS)


def region_cost(
    request: RegionRequest,
    region: RegionView,
    topology: RegionTopology,
    *,
    can_move: bool,
    sources: Mapping[str, RegionLoad] | None = None,
) -> RegionCost:
    """The cost of serving `request` in `region` (which has a summary). With `can_move`, a longer
    copy of another region (`request.held`, as that region's feed last named it, whether or not
    its scheduler answers now: a pull needs only its node) may move first; `sources`: the other
    regions' summaries, for what reading their copy costs."""
    load = region.load
    assert load is not None, "a region is priced from its summary"
    total = prompt_tokens(request)
    held = request.held.get(region.name, 0)
    rtt = topology.rtt_ms(request.client_region, region.name)
    u = fill(load)
    per_token = load.prefill_ms_per_token / (1 - u)
    starts_session = request.session is not None and not request.held
    queue = load.queue_ms / (1 - u) if starts_session else load.queue_ms
    own = held * load.held_load_ms_per_token
    best = RegionCost(rtt, queue, load.request_overhead_ms, per_token * (total - held), fill=u, load_ms=own)
    if not can_move:
        return best
    for source, tokens in request.held.items():
        more = tokens - held
        if source == region.name or more <= 0 or not topology.allowed(request.tenant, source):
            continue
        at_source = (sources or {}).get(source)
        read = (at_source or load).held_read_ms_per_token
        wire = move_ms(topology, source, region.name, more, load.kv_bytes_per_token)
        moving = more * (read + load.pulled_load_ms_per_token) + wire
        computing = per_token * (total - held - more)
        if moving + computing < best.prefill_ms + best.move_ms:
            best = RegionCost(rtt, queue, load.request_overhead_ms, computing, moving, source, u, own)
    return best
