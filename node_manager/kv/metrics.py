"""Prometheus metrics of one KV store (own registry, so two stores in one test process don't collide)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from node_manager.kv.pages import Tier

_IO_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# deadline - completion: positive = finished ahead of the request, negative = late.
_LEAD_BUCKETS = (-10.0, -1.0, -0.1, 0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# How long the forward waited for one layer's KV: ~0 when loads run ahead of compute.
_LAYER_WAIT_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0)


class KVMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.tier_bytes = Gauge("symphony_kv_tier_bytes", "Bytes of KV pages held per tier", ["tier"], registry=r)
        self.tier_pages = Gauge("symphony_kv_tier_pages", "KV pages held per tier", ["tier"], registry=r)
        self.tier_capacity = Gauge(
            "symphony_kv_tier_capacity_bytes", "Configured capacity per tier", ["tier"], registry=r
        )
        self.hits = Counter(
            "symphony_kv_load_hits_total", "Pages a load found, by the tier that served them", ["tier"], registry=r
        )
        self.misses = Counter("symphony_kv_load_misses_total", "Pages a load found in no tier", registry=r)
        self.load_errors = Counter(
            "symphony_kv_load_errors_total", "Pages that could not be loaded", ["reason"], registry=r
        )
        self.evictions = Counter(
            "symphony_kv_evictions_total", "Page copies evicted, by tier and reason", ["tier", "reason"], registry=r
        )
        self.last_copy_dropped = Counter(
            "symphony_kv_last_copy_dropped_total", "Pages dropped with no copy left in any tier", ["reason"], registry=r
        )
        self.save_degraded = Counter(
            "symphony_kv_save_degraded_total",
            "Pages a save could not keep (or not persist), by reason",
            ["reason"],
            registry=r,
        )
        self.io_bytes = Counter(
            "symphony_kv_io_bytes_total", "Bytes moved, by tier and direction", ["tier", "direction"], registry=r
        )
        self.io_seconds = Histogram(
            "symphony_kv_io_seconds",
            "Duration of one I/O batch, by tier and direction",
            ["tier", "direction"],
            buckets=_IO_BUCKETS,
            registry=r,
        )
        self.prefetches = Counter("symphony_kv_prefetches_total", "Prefetches by outcome", ["outcome"], registry=r)
        self.prefetch_lead = Histogram(
            "symphony_kv_prefetch_lead_seconds",
            "Prefetch deadline minus completion time (negative: late)",
            buckets=_LEAD_BUCKETS,
            registry=r,
        )
        self.segments_damaged = Counter(
            "symphony_kv_ssd_segments_damaged_total", "Segment files dropped at index rebuild as damaged", registry=r
        )
        self.segments_quarantined = Counter(
            "symphony_kv_ssd_segments_quarantined_total",
            "Segment files that could not be read at index rebuild (an I/O error): not loaded, moved to "
            "<ssd_dir>/quarantine/ (the newest 64 kept) or, past 64 a start, left in place",
            registry=r,
        )
        self.segments_other_model = Counter(
            "symphony_kv_ssd_segments_other_model_total",
            "Segment files of another model (fingerprint) found at index rebuild and not loaded: dropped, or kept "
            "on disk for a rollback (kv.ssd_keep_other_models)",
            ["action"],
            registry=r,
        )
        self.other_model_segments = Gauge(
            "symphony_kv_ssd_other_model_segments",
            "Segment files of other models kept on disk, not loaded (evicted first when room is needed)",
            registry=r,
        )
        self.peer_pages = Counter(
            "symphony_kv_peer_pages_total", "Pages received from peers, by outcome", ["outcome"], registry=r
        )
        self.peer_refused = Counter(
            "symphony_kv_peer_refused_total",
            "Page pulls refused because the two nodes serve different models (fingerprints), by side: "
            "sender (this node refused a peer) or receiver (this node refused a peer's pages)",
            ["side"],
            registry=r,
        )

        # The vLLM connector's view (served over the node-local KV channel, reported by its sides).
        self.connector_tokens_loaded = Counter(
            "symphony_connector_tokens_loaded_total",
            "Prompt tokens the connector loaded into vLLM instead of computing, by the tier that served them "
            "(SSD: the load promoted pages from SSD)",
            ["tier"],
            registry=r,
        )
        self.connector_prompt_tokens = Counter(
            "symphony_connector_prompt_tokens_total",
            "Prompt tokens of requests vLLM admitted, by where their KV came from: engine_cache (vLLM's own "
            "prefix cache), symphony (loaded from the node's tiers), computed (prefilled)",
            ["source"],
            registry=r,
        )
        self.connector_tail_tokens_saved = Counter(
            "symphony_connector_tail_tokens_saved_total",
            "Tokens of finished turns' partial last blocks saved for the next turn to load",
            registry=r,
        )
        self.connector_load_errors = Counter(
            "symphony_connector_load_error_blocks_total",
            "vLLM blocks whose planned load failed and were recomputed instead",
            registry=r,
        )
        self.connector_layer_wait = Histogram(
            "symphony_connector_layer_wait_seconds",
            "Time the forward pass waited for one layer's KV to load",
            buckets=_LAYER_WAIT_BUCKETS,
            registry=r,
        )
        self.prefetch_arrivals = Counter(
            "symphony_kv_prefetch_arrivals_total",
            "Requests for a session with a prefetch, by whether its KV was all in the prefetch's target tier "
            "when the request arrived (ready) or not",
            ["ready"],
            registry=r,
        )

        self.engine_warmups = Counter(
            "symphony_engine_warmups_total",
            "Top-tier prefetches' warm-up requests, by outcome: cached (the engine's prefix cache took the "
            "history), skipped (engine busy or not ready), failed",
            ["outcome"],
            registry=r,
        )
        self.engine_warmup_tokens = Counter(
            "symphony_engine_warmup_cached_tokens_total",
            "History tokens warm-ups left in the engine's prefix cache",
            registry=r,
        )

        # Block events (`block_events`, `block_watch`): the stream the scheduler's cluster KV index reads.
        self.block_events = Counter(
            "symphony_kv_block_events_total",
            "Block keys named by published block events (a CLEARED event counts 1), by kind and tier",
            ["kind", "tier"],
            registry=r,
        )
        self.block_event_batches = Counter(
            "symphony_kv_block_event_batches_total", "Live block event batches sealed (given a seq)", registry=r
        )
        self.block_event_subscriptions = Counter(
            "symphony_kv_block_event_subscriptions_total",
            "WatchBlocks streams, by how they started: replay (resumed from the ring), snapshot, or refused "
            "(kv.block_events_max_subscribers reached)",
            ["start"],
            registry=r,
        )
        self.block_event_subscribers = Gauge(
            "symphony_kv_block_event_subscribers", "WatchBlocks streams open", registry=r
        )
        self.block_event_dropped = Counter(
            "symphony_kv_block_event_subscribers_dropped_total",
            "WatchBlocks streams ended because their reader fell behind (it resubscribes)",
            registry=r,
        )
        self.block_event_engine_overflow = Counter(
            "symphony_kv_block_event_engine_overflow_total",
            "Engine-tier block keys neither remembered nor published: kv.block_events_engine_keys were held",
            registry=r,
        )

    def count_rebuild(self, damaged: int, quarantined: int, other_models: int, kept: bool) -> None:
        """What an SSD index rebuild set aside (`SsdTier.rebuild`'s report)."""
        self.segments_damaged.inc(damaged)
        self.segments_quarantined.inc(quarantined)
        self.segments_other_model.labels("kept" if kept else "dropped").inc(other_models)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TierMeters:
    """The per-tier series of one store that every load and save updates, looked up once: a labelled
    child costs a lock and a dict lookup, on every layer of a load. Thread-safe; no store lock needed."""

    def __init__(self, metrics: KVMetrics, page_bytes: int) -> None:
        self._page_bytes = page_bytes
        self._hits = {tier: metrics.hits.labels(tier.name) for tier in Tier}
        self._io = {
            (tier, direction): (
                metrics.io_bytes.labels(tier.name, direction),
                metrics.io_seconds.labels(tier.name, direction),
            )
            for tier in Tier
            for direction in ("read", "write")
        }

    def count_hits(self, tier: Tier, pages: int) -> None:
        """`pages` a load found in `tier`."""
        self._hits[tier].inc(pages)

    def observe_io(self, tier: Tier, direction: str, pages: int, started: float) -> None:
        """`pages` read or written in `tier` (direction "read" | "write") as one batch, begun at
        `time.perf_counter()` == `started`."""
        nbytes, seconds = self._io[tier, direction]
        nbytes.inc(pages * self._page_bytes)
        seconds.observe(time.perf_counter() - started)
