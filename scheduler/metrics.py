"""Prometheus metrics of the scheduler, in a registry of its own (tests build several schedulers)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; spans a local prefix-cache hit on a GPU (~10 ms) to a long CPU prefill (~1 min).
# An advisory is answered in well under the 5 ms it is allowed.
ADVISORY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1)
# Seconds from a node publishing a block event batch to the scheduler applying it.
KV_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
# Seconds to apply a node's whole snapshot (a restarted scheduler rebuilds its index from them).
KV_SNAPSHOT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Seconds the tokenizer thread takes per request: ~0.1 ms for a turn tokenized incrementally, a few
# ms for a few thousand tokens tokenized whole.
TOKENIZE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "symphony_requests", "Inference requests by endpoint and HTTP status", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "symphony_ttft_seconds",
            "Time to first streamed chunk, measured at the scheduler",
            ["endpoint", "priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "symphony_e2e_seconds",
            "Request arrival to last byte sent to the client",
            ["endpoint", "stream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.routed = Counter(
            "symphony_routed", "Requests dispatched per node and routing reason", ["node", "reason"], registry=r
        )
        self.control_save_failures = Counter(
            "symphony_control_save_failures",
            "Admin changes applied but not saved (they hold until a restart): scheduler.control",
            registry=r,
        )
        self.membership_changes = Counter(
            "symphony_membership_changes",
            "Nodes that joined or left this scheduler by etcd's member list (change=join|leave)",
            ["change"],
            registry=r,
        )
        self.membership_read_failures = Counter(
            "symphony_membership_read_failures",
            "Reads of etcd's member list that failed (the nodes followed stay as they were)",
            registry=r,
        )
        self.residency_refused = Counter(
            "symphony_residency_refused",
            "Requests and advisories refused because the tenant's data may not enter this region",
            ["tenant"],
            registry=r,
        )
        self.quota_refused = Counter(
            "symphony_quota_refused",
            "Requests and advisories refused (429) by the tenant's own quota ([quotas]): over its rate of "
            "requests or advisories, at its cap of requests in flight, or of requests held back",
            ["tenant", "reason"],
            registry=r,
        )
        self.read_timeouts = Counter(
            "symphony_http_read_timeouts",
            "Client connections closed for not sending a whole request within scheduler.request_read_timeout_s",
            registry=r,
        )
        self.retries = Counter(
            "symphony_dispatch_retries",
            "Requests re-sent to another node because the first engine could not be reached",
            ["node"],
            registry=r,
        )
        self.advisories = Counter(
            "symphony_advisories",
            "Advisories accepted, by kind and what they did: routed "
            "(node chosen, KV moved there) or ignored (the policy takes no advisories)",
            ["kind", "outcome"],
            registry=r,
        )
        self.prefetches = Counter(
            "symphony_prefetches",
            "KV moves the scheduler asked a node for, by how they "
            "ended (done, partial, failed, not_found: nothing to move, skipped_busy, skipped_gone: the node "
            "or the source left the cluster; "
            "unchanged: not asked, the same KV reached that node moments ago; in_engine: not asked, the "
            "node's engine cache holds the session's last prompt; loads_on_arrival: not asked, loading "
            "the node's copy at the request's arrival costs less than a warm-up pass)",
            ["outcome"],
            registry=r,
        )
        self.advised_requests = Counter(
            "symphony_advised_requests",
            "Requests whose advisory moved KV, by kind and whether the KV was in the node's top tier when they arrived",
            ["kind", "kv_ready"],
            registry=r,
        )
        self.route_pulls = Counter(
            "symphony_route_pulls",
            "Requests routed away from the node holding their "
            "session's KV with no advisory moving it, whose KV was pulled over first: "
            "ready (arrived within scheduler.route_pull_wait_ms), late (sent before it "
            "finished), failed, not_started (no follow slot)",
            ["outcome"],
            registry=r,
        )
        self.prefix_pulls = Counter(
            "symphony_route_prefix_pulls",
            "Requests routed to a node lacking their prompt's shared prefix (a system prompt) that "
            "another node holds, whose copy was pulled over first under the name of a session "
            "that has it: ready, late, failed, not_started (as symphony_route_pulls)",
            ["outcome"],
            registry=r,
        )
        self.priority_requests = Counter(
            "symphony_priority_requests", "Requests dispatched, by priority tier", ["priority"], registry=r
        )
        self.queue_wait = Histogram(
            "symphony_queue_wait_seconds",
            "Time requests waited in the scheduler for a node with room (selective pushing), by priority tier",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.overloaded = Counter(
            "symphony_overloaded",
            "Requests refused (503) that would wait for a node past scheduler.max_queue_wait_s, by priority tier",
            ["priority"],
            registry=r,
        )
        self.queued = Gauge("symphony_queued_requests", "Requests waiting in the scheduler for a node", registry=r)
        self.requeued = Counter(
            "symphony_queue_requeued",
            "Requests put back at the head of the queue: woken but found no room, or sent again after an"
            " unreachable engine",
            registry=r,
        )
        self.advisory_followups = Counter(
            "symphony_advisory_followups",
            "Requests that had a pending advisory: honored (went to the advised node) or rerouted (node unavailable)",
            ["outcome"],
            registry=r,
        )
        self.advisories_dropped = Counter(
            "symphony_advisories_dropped",
            "Advisories never followed by their request: expired, or evicted by the table's size bound",
            ["reason"],
            registry=r,
        )
        self.advisory_latency = Histogram(
            "symphony_advisory_seconds",
            "Time the scheduler took to answer an accepted advisory (headers in to reply out)",
            buckets=ADVISORY_BUCKETS,
            registry=r,
        )
        self.advisories_pending = Gauge(
            "symphony_advisories_pending", "Advisories waiting for their request", registry=r
        )
        self.kv_located = Counter(
            "symphony_kv_located",
            "Requests of a KV-locating policy, by where their per-node prefixes came from: index (the "
            "cluster KV index, for the nodes it is current for), hints (no node's index is current: the "
            "session table), no_ids (no token ids: the session table), skipped (one node could serve)",
            ["source"],
            registry=r,
        )
        self.token_ids_from_engine = Counter(
            "symphony_token_ids_from_engine",
            "Requests whose ids were asked of an engine's /tokenize while the scheduler's tokenizer was "
            "loading, by outcome: ok, none (no engine, an error, no answer in time, a body /tokenize "
            "cannot reproduce)",
            ["outcome"],
            registry=r,
        )
        self.token_ids_missing = Counter(
            "symphony_token_ids_missing",
            "Requests the scheduler computed no token ids for (its caller falls back), by reason: "
            "no_tokenizer, loading, invalid_input (vLLM refuses it too), unsupported (media, prompt "
            "embeddings, several prompts, ...), timeout, busy (too many waiting), error",
            ["reason"],
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            "symphony_tokenize_seconds",
            "Time the scheduler's tokenizer thread took per request, by how: full, incremental (from "
            "the session's previous prompt), unchanged (the same prompt again), ids (sent as token ids)",
            ["mode"],
            buckets=TOKENIZE_BUCKETS,
            registry=r,
        )
        self.tokenize_cache_sessions = Gauge(
            "symphony_tokenize_cache_sessions", "Sessions whose last prompt the tokenizer keeps", registry=r
        )
        self.tokenize_cache_tokens = Gauge(
            "symphony_tokenize_cache_tokens", "Token ids the tokenizer keeps for sessions' last prompts", registry=r
        )
        self.node_up = Gauge("symphony_node_up", "1 when the node is routable", ["node"], registry=r)
        self.node_load = Gauge("symphony_node_load", "Engine running + waiting requests (polled)", ["node"], registry=r)
        self.node_inflight = Gauge(
            "symphony_node_inflight", "Requests this scheduler has in flight on the node", ["node"], registry=r
        )
        self.node_kv_usage = Gauge("symphony_node_kv_cache_usage", "Engine KV cache usage, 0..1", ["node"], registry=r)
        self.node_engine_restarts = Gauge(
            "symphony_node_engine_restarts", "Engine restarts reported by the node", ["node"], registry=r
        )
        self.link_observed_ms_per_token = Gauge(
            "symphony_link_observed_ms_per_token",
            "Observed pull time per token fetched, beyond RTT and tier reads (scheduler.pull_costs)",
            ["source", "target"],
            registry=r,
        )

        self._kv_index_metrics(r)

    def _kv_index_metrics(self, r: CollectorRegistry) -> None:
        """The cluster KV index (scheduler.kv_index) and the block event streams feeding it."""
        self.kv_index_blocks = Gauge(
            "symphony_kv_index_blocks",
            "Blocks the cluster KV index holds (at most scheduler.kv_index_max_blocks)",
            registry=r,
        )
        self.kv_index_bytes = Gauge(
            "symphony_kv_index_bytes", "Estimated bytes of the cluster KV index (allocated at start)", registry=r
        )
        self.kv_index_evictions = Counter(
            "symphony_kv_index_evictions", "Blocks the cluster KV index evicted, least recently used first", registry=r
        )
        self.kv_index_events = Counter(
            "symphony_kv_index_events", "Block events applied, by kind and tier", ["kind", "tier"], registry=r
        )
        self.kv_index_event_blocks = Counter(
            "symphony_kv_index_event_blocks",
            "Block keys named by the events applied, by kind and tier",
            ["kind", "tier"],
            registry=r,
        )
        self.kv_index_resyncs = Counter(
            "symphony_kv_index_resyncs",
            "Times a node's index entries had to be rebuilt from a snapshot, by reason (gap, heartbeat_ahead, "
            "out_of_order, epoch, not_synced, malformed, snapshot_cut, fingerprint, restart, expired)",
            ["reason"],
            registry=r,
        )
        self.kv_index_lag = Histogram(
            "symphony_kv_index_lag_seconds",
            "Block event batches: arrival at the scheduler minus the node's published time (clocks of two hosts)",
            buckets=KV_LAG_BUCKETS,
            registry=r,
        )
        self.kv_index_snapshot = Histogram(
            "symphony_kv_index_snapshot_seconds",
            "Time from a node's snapshot's first batch to its last one applied",
            buckets=KV_SNAPSHOT_BUCKETS,
            registry=r,
        )
        self.kv_index_fallback = Gauge(
            "symphony_kv_index_fallback",
            "1 while the node's block stream is down or out of sync: routing uses the session table's hints for it",
            ["node"],
            registry=r,
        )
        self.kv_watch_reconnects = Counter(
            "symphony_kv_watch_reconnects",
            "Block event streams ended and resubscribed, by reason (timeout, ended, an RPC status, a resync reason)",
            ["reason"],
            registry=r,
        )

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
