"""The configuration's keys: one frozen dataclass per TOML section, each key with its type, default
and unit. Loading, validation and rendering are `symphony.config`'s, which re-exports these.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from symphony.regions import DEFAULT_WAN_LINKS, RegionTopology, build_topology

# The enumerated keys' values; load_config refuses any other and names these.
PolicyName = Literal["symphony", "recompute", "sticky", "round_robin", "least_load", "consistent_hash", "prefix_trie"]
DataPlane = Literal["tcp", "grpc"]
EngineDtype = Literal["bfloat16", "float16", "float32", "auto"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]
RegionPolicyName = Literal["nearest", "skywalker", "gorgo", "gorgo_no_queue", "symphony"]


@dataclass(frozen=True)
class ClusterConfig:
    nodes: int = 2  # node managers (each with one engine) that `symphony up` starts
    # The secret the cluster's processes share (at least 16 characters): it keys the tenants'
    # engine cache salts, the pages' MACs, the signed kv_transfer_params and the internal token
    # (docs/architecture.md). Empty: the one kept in <home>/cluster.secret, made on first use
    # (symphony.config_secrets); processes on other homes must be given the same one.
    secret: str = ""
    # Mutual TLS on the node managers' gRPC and page streams (symphony.cluster_tls): only holders
    # of a certificate of the cluster's CA may call them. Certificates in `tls_dir` (empty:
    # <home>/tls), made there on first use for this host (`symphony certs init`). Off by default
    # for now: a cluster whose processes all listen on loopback (the local default) is contained.
    tls: bool = False
    tls_dir: str = ""
    # etcd, the coordination store (symphony.etcd_client): its client URLs. Empty (the default):
    # none; a scheduler's nodes are scheduler.node_addresses (else the local cluster's) and its
    # admin changes a file in its home. Set: node managers register under a lease
    # (symphony.membership) and schedulers follow who is registered.
    etcd_endpoints: list[str] = field(default_factory=list)
    etcd_prefix: str = "/symphony"  # the cluster's keys in etcd: clusters sharing an etcd differ here
    membership_ttl_s: int = 5  # a node manager that stops renewing leaves membership this long after
    # `symphony up` runs scheduler.replicas schedulers (2 or more) over etcd: the one etcd_endpoints
    # names, else one it starts itself, its data in <home>/run/etcd, its client port
    # etcd_port_base (its peer port the next). `symphony up --ha` sets this (and 2 replicas).
    ha: bool = False
    etcd_port_base: int = 12379


@dataclass(frozen=True)
class SchedulerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # gRPC addresses of the node managers ("host:port"). Empty: the local cluster's
    # node.host:node.grpc_port_base+i for i < cluster.nodes.
    node_addresses: list[str] = field(default_factory=list)
    # With regions.layout: the region this scheduler serves (its port regions.scheduler_port_base +
    # the region's index; its nodes node_addresses, else the region's nodes of the local cluster);
    # empty: the global layer's configuration.
    region: str = ""
    policy: PolicyName = "symphony"  # scheduler.policies.POLICIES holds one policy per name
    poll_interval_ms: int = 100  # Status poll period per node
    node_down_after_ms: int = 1000  # no successful Status for this long -> node unroutable
    membership_poll_ms: int = 500  # with cluster.etcd_endpoints: how often the member list is read
    # Schedulers `symphony up` runs with cluster.ha (2 there unless set), replica i on port + i,
    # all over the same nodes and sharing their admin changes through etcd; clients are given
    # every replica's URL.
    replicas: int = 1
    connect_timeout_s: float = 2.0  # to an engine; a dead engine must fail fast, not hang
    request_timeout_s: float = 600.0  # between bytes from an engine once connected
    max_inflight_requests: int = 1024  # beyond this the scheduler answers 429
    max_body_bytes: int = 4 * 1024 * 1024
    # A client must send each request whole (request line, headers, body) within this many seconds
    # of its first byte (of opening the connection, for the first): else the connection is closed.
    request_read_timeout_s: float = 30.0
    # An idle client connection is kept this long for its next request. Longer than the pools of
    # the usual clients keep one (httpx, so the `openai` client: 5 s; aiohttp: 15 s): were it the
    # same, a request sent as the server closes the connection breaks (uvicorn's default is 5 s).
    # 75 s, as nginx and aiohttp's `run_app` keep theirs. The global layer's entries keep theirs
    # this long too (aiohttp's own default there is an hour).
    keep_alive_s: int = 75  # seconds (uvicorn takes whole ones)
    max_session_id_len: int = 128
    advisory_ttl_s: float = 120.0  # an advisory not followed by a request within this is dropped
    max_advisories: int = 100_000  # pending advisories kept (LRU beyond)
    max_expected_arrival_ms: int = 3_600_000  # hints further out than this are rejected
    typing_lead_ms: int = 10_000  # a typing advisory's prefetch deadline: when its request is likely to come
    max_prefetches: int = 256  # KV moves followed at once; beyond, an advisory routes but moves nothing
    # A request routed away from the node holding its session's KV with no advisory moving it there
    # (none came, or its node got a queue) waits at most this long for the KV to be pulled over;
    # 0: never pulls, the engine recomputes the history. On this kind of engine a pull costs tens of
    # ms where recomputing a long history costs seconds.
    route_pull_wait_ms: int = 3000
    route_pull_min_tokens: int = 64  # less history than this elsewhere is recomputed rather than pulled
    max_sessions: int = 100_000  # session table entries, and sticky's pinned sessions (least recently used beyond)
    prefix_trie_max_chars: int = 4_000_000  # prefix_trie's tree of served prompts (~1M tokens of text)
    session_ttl_s: float = 3600.0  # a session unused this long is forgotten
    max_priority_settings: int = 100_000  # tenant and session priority tiers an admin may set
    # The cluster KV index (scheduler/kv_index.py): which node holds which blocks in which tier,
    # from each node's stream of block events (KVStore.WatchBlocks). Off: no streams, no index.
    kv_index_enabled: bool = True
    # Blocks indexed (least recently used beyond): ~49 bytes each at 64 nodes, ~18 at up to 8,
    # allocated at start.
    kv_index_max_blocks: int = 1_000_000
    # A node's stream that brings no batch or heartbeat for this long is reconnected (the nodes
    # send a heartbeat about once a second).
    kv_watch_timeout_ms: int = 3000
    kv_watch_backoff_max_ms: int = 5000  # longest wait between a node's resubscriptions (doubling from 100 ms)
    max_queued_requests: int = 1024  # requests held back by selective pushing; beyond: 429
    queue_timeout_s: float = 60.0  # a held-back request that finds no room by then: 503
    # A request that would be held back longer than this, by the rate engine slots free up, is
    # refused at once (503 with Retry-After) rather than queued (scheduler/admission.py): past
    # capacity the queue then stays this short instead of growing to queue_timeout_s (the smaller
    # of the two applies).
    max_queue_wait_s: float = 10.0
    # Tenants' API keys, "tenant:key" each; empty: no authentication, every request is tenant "default".
    api_keys: list[str] = field(default_factory=list)
    admin_token: str = ""  # bearer token of the admin API (/admin/v1/...); empty: the admin API is off
    # The tokenizer the scheduler computes requests' token ids with (scheduler/tokenizer_load.py): that
    # of the model [engine] describes, served as engine.served_model_name (else its directory's name).
    # "auto": its directory, when the scheduler runs the local cluster (no node_addresses); a path;
    # "": none (requests get no token ids).
    tokenizer: str = "auto"
    tokenizers: list[str] = field(default_factory=list)  # other served models': "served_name=path" each
    tokenizer_cache_sessions: int = 10_000  # sessions whose last prompt is kept to tokenize the next from
    tokenizer_cache_tokens: int = 4_000_000  # token ids kept for them in all (least recently used out)
    # Block keys whose donor session is kept (least recently used out, ~150-200 bytes each): a shared
    # prefix moves between nodes only under the name of a session that has it (scheduler/kv_locator.py).
    prefix_donor_blocks: int = 262_144
    tokenize_timeout_ms: int = 1000  # a request not tokenized by then gets no token ids
    # The cost profile the `symphony` policy prices routes with (JSON, `symphony bench calibrate`
    # writes it); empty: <home>/cost-profile.json. Missing, implausible or stale: built-in defaults.
    cost_profile: str = ""
    cost_profile_max_age_days: float = 30.0  # a profile measured longer ago than this is stale

    @property
    def queue_wait_bound_s(self) -> float:
        """The longest a request is admitted to wait for a node: `max_queue_wait_s`, or
        `queue_timeout_s` where that is shorter (it gives up then anyway)."""
        return min(self.max_queue_wait_s, self.queue_timeout_s)


@dataclass(frozen=True)
class NodeConfig:
    host: str = "127.0.0.1"  # bind and advertise address of the node manager and its engine
    grpc_port_base: int = 50051  # node i listens on grpc_port_base + i
    engine_port_base: int = 8100  # node i's engine listens on engine_port_base + i
    engine_scrape_interval_ms: int = 100  # how often the node manager reads the engine's /metrics
    # Where the cluster's other processes (schedulers, peers) reach node i, when not where it
    # listens: a proxy, a NAT or an emulated link in front of it. "" and 0 keep `host` and the port
    # it listens on. Its own engine, KV channel and metrics it still reaches where they listen.
    advertise_host: str = ""
    advertise_grpc_port_base: int = 0  # node i's gRPC: advertise_grpc_port_base + i
    advertise_engine_port_base: int = 0  # node i's engine: advertise_engine_port_base + i
    advertise_data_port_base: int = 0  # node i's page stream (kv.data_plane "tcp"): base + i


def flag_values(args: Sequence[str], *flags: str) -> list[str]:
    """The values `args` (a vLLM command line's) gives any of `flags`, in order: "--flag value" or
    "--flag=value" (a flag last with no value gives none)."""
    values = []
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag not in flags:
            continue
        if eq:
            values.append(inline)
        elif i + 1 < len(args):
            values.append(args[i + 1])
    return values


VLLM_CPU_MAX_NUM_SEQS = 128  # vLLM CPU's --max-num-seqs for its OpenAI server (vllm/engine/arg_utils.py)


@dataclass(frozen=True)
class EngineConfig:
    enabled: bool = True  # false: the node manager runs only its KV store (storage-only nodes, tests)
    model: str = ""  # local HF model directory; empty: SmolLM2-135M-Instruct from `symphony model fetch`
    served_model_name: str = ""  # name clients pass as `model`; empty: the model directory's name
    dtype: EngineDtype = "bfloat16"
    block_size: int = 32  # vLLM CPU needs a multiple of 32
    max_model_len: int = 8192
    # Requests the engine runs at once, passed to vLLM as --max-num-seqs; 0: not passed, vLLM's own
    # default (vLLM CPU's is 128, which the region then counts: set it on GPU builds, whose default
    # depends on the GPU). The global layer prices a region's fill by it (global_layer.costs).
    max_num_seqs: int = 0
    kv_cache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE; ignored on GPU builds
    enforce_eager: bool = True  # skip torch.compile: ~30 s start instead of minutes on CPU
    kv_connector: bool = True  # Symphony's KV connector: turns load from and save to the node's tiers
    # vLLM's KV events (blocks its own prefix cache stores and evicts), published on an endpoint
    # private to the node (`SymphonyConfig.engine_events_endpoint`) and translated to Symphony's
    # block keys: the engine's cache as a tier of the cluster's KV index. Turns prefix caching on.
    kv_events: bool = True
    # vLLM block hashes whose Symphony keys the translation keeps (least recently used beyond; one
    # forgotten is reported removed); 0: twice the engine's KV blocks, from kv_cache_space_gib or
    # --num-gpu-blocks-override in extra_args (set it on GPU builds, where the former is ignored).
    kv_events_max_blocks: int = 0
    # CPU engines: the cores each computes on. "auto": the host's cores split between the local
    # cluster's engines; "vllm": vLLM's own binding (every engine on the same first cores); or vLLM
    # core lists per node index, "|"-separated ("0-3|4-7").
    cpu_cores: str = "auto"
    # Scheduling niceness of the engine process (0-19; 0: as the node manager), set for its whole
    # session's autogroup too (symphony.pdeathsig_exec). On a CPU host the engine's forward passes
    # would otherwise take every core from the scheduler and the node managers, whose work is short
    # but on every request's path (docs/design-notes.md#engine-niceness). On a GPU host the engine
    # needs little CPU.
    nice: int = 5
    # vLLM's AMX attention kernel on CPUs that have AMX (bfloat16, blocks of 32). Off: its vector
    # kernel serves instead (node_manager/vllm_plugin.py; docs/design-notes.md#amx-attention).
    cpu_amx_attention: bool = False
    extra_args: list[str] = field(default_factory=list)  # appended to the vLLM server command line
    startup_timeout_s: float = 300.0
    max_restarts: int = 5  # crash restarts before the node reports FAILED
    restart_backoff_s: float = 1.0  # first back-off; doubles per consecutive crash
    restart_backoff_max_s: float = 30.0
    stable_after_s: float = 120.0  # a run this long resets the consecutive-crash count
    stop_timeout_s: float = 20.0  # SIGTERM grace before SIGKILL
    liveness_timeout_s: float = 60.0  # a ready engine failing /health this long is restarted as hung

    def max_running(self) -> int:
        """Requests the engine runs at once: the last --max-num-seqs of `extra_args` (vLLM reads the
        command line's last; it takes --max_num_seqs too), else `max_num_seqs`, else vLLM CPU's default."""
        given = [int(v) for v in flag_values(self.extra_args, "--max-num-seqs", "--max_num_seqs") if v.isdigit()]
        return next((v for v in reversed(given) if v > 0), self.max_num_seqs or VLLM_CPU_MAX_NUM_SEQS)

    def max_running_set(self) -> int:
        """`max_running()` when set here (`max_num_seqs`, or --max-num-seqs in `extra_args`); else 0:
        vLLM's own default depends on its build and its GPU."""
        flags = flag_values(self.extra_args, "--max-num-seqs", "--max_num_seqs")
        given = any(v.isdigit() and int(v) > 0 for v in flags)
        return self.max_running() if given or self.max_num_seqs > 0 else 0


@dataclass(frozen=True)
class KVConfig:
    """The node manager's tiered KV store. Capacities are per node; lower tiers must be >= upper."""

    hbm_bytes: int = 256 * 1024**2  # staged pages in engine device memory (the CPU here)
    dram_bytes: int = 1024**3  # shared-memory arena the vLLM worker maps
    ssd_bytes: int = 16 * 1024**3  # segment files under ssd_dir
    ssd_dir: str = ""  # empty: <home>/kv/<node id>
    device: str = "cpu"  # HBM tier device: "cpu" or "cuda[:N]"
    io_threads: int = 2  # copy and file I/O threads per node
    max_inflight_jobs: int = 256  # queued layer loads and save copies; beyond, loads get RESOURCE_EXHAUSTED
    segment_max_bytes: int = 8 * 1024**2  # write-behind batches up to this many bytes per SSD file
    ssd_writers: int = 2  # write-behind threads: segments written at once (the SSD's queue depth)
    max_sessions: int = 100_000  # session records kept (LRU beyond; their pages age out by tier policy)
    max_session_tokens: int = 1_048_576
    max_pending_prefetches: int = 4096
    prefetch_concurrency: int = 2
    peer_timeout_s: float = 30.0  # a node-to-node page stream that stalls this long is abandoned
    # Node-to-node page pulls: "tcp" (a raw page stream; gRPC's FetchPages when the peer has none) or
    # "grpc" (FetchPages only, e.g. where only the gRPC port is open between nodes).
    data_plane: DataPlane = "tcp"
    data_port_base: int = 0  # node i's page stream listens on base + i; 0: a free port, advertised in status
    metrics_port_base: int = 9300  # node i serves Prometheus /metrics on base + i; 0 disables
    # A TIER_HBM prefetch ends with a warm-up request that puts the history in vLLM's own prefix
    # cache, sent only while no request waits and the engine's KV usage is below this fraction
    # (a warm-up must never delay a real request); 0 disables warm-ups.
    engine_warmup_max_kv_usage: float = 0.8
    engine_warmup_timeout_s: float = 30.0
    # At start, SSD segments of another model (another fingerprint: weights, tokenizer, dtype, block
    # size or page layout) are never loaded. false: they are deleted; true: kept on disk for a
    # rollback to that model, counted against ssd_bytes and evicted first when room is needed.
    ssd_keep_other_models: bool = False
    # What the SSD tier leaves free on its filesystem: it holds at most ssd_bytes, and less when the
    # disk has less room than that beyond this (others' files, a small disk), evicting to stay so.
    ssd_headroom_bytes: int = 1024**3
    # Block events (KVStore.WatchBlocks: the scheduler's cluster KV index follows them). An entry is
    # a block key or an event; a batch holds at most block_events_batch_entries of them.
    block_events_ring_batches: int = 4096  # recent batches kept for a subscriber resuming after a seq
    block_events_ring_entries: int = 1_048_576  # ... and their entries, all together
    block_events_batch_entries: int = 1024  # per batch, live or snapshot (>= 2)
    block_events_subscriber_backlog: int = 1024  # batches a subscriber may lag before it is dropped
    block_events_max_subscribers: int = 8  # beyond: RESOURCE_EXHAUSTED
    block_events_engine_keys: int = 1_048_576  # engine-held blocks remembered for snapshots
    block_events_heartbeat_s: float = 1.0  # an idle stream sends a heartbeat this often


@dataclass(frozen=True)
class LoggingConfig:
    level: LogLevel = "info"  # any case in the file or environment
    format: LogFormat = "text"  # text: key=value


@dataclass(frozen=True)
class RegionsConfig:
    """A cluster of several regions (symphony.regions): one scheduler per region, a global layer
    with an entry in each, and every cross-region connection through an emulated WAN link."""

    # "name:nodes" per region, in order (nodes numbered across regions); empty: one region, no
    # global layer. cluster.nodes must be the total, and kv.data_plane "grpc" (pulls across
    # regions go through the WAN links; `symphony up --regions` sets both).
    layout: list[str] = field(default_factory=list)
    # "a~b:rtt_ms:bandwidth_mbps[:jitter_ms[:loss]]" for every pair of regions in the layout.
    links: list[str] = field(default_factory=lambda: list(DEFAULT_WAN_LINKS))
    intra_rtt_ms: float = 1.0  # a client to its own region's entry, and within a region (not emulated)
    # "tenant=region|region": the only regions the tenant's requests and KV may enter.
    residency: list[str] = field(default_factory=list)
    policy: RegionPolicyName = "nearest"  # the global layer's choice of region
    scheduler_port_base: int = 8010  # region r's scheduler on base + r (entries: scheduler.port + r)
    link_port_base: int = 7400  # the WAN links' control API; their listeners from base + 1
    probe_interval_ms: int = 100  # the global layer reads each region's summary this often
    region_down_after_ms: int = 500  # no summary for this long: the region takes no new requests


@dataclass(frozen=True)
class QuotasConfig:
    """Per-tenant limits (symphony/tenant_quotas.py), each tenant's own; 0 turns one off (the
    scheduler's own bounds still hold). Refusals answer 429, with Retry-After for the rates."""

    requests_per_s: float = 0.0  # inference requests a tenant may send per second, sustained
    request_burst: int = 0  # ... and at once after a pause; 0: the rate rounded up (at least 1)
    advisories_per_s: float = 0.0
    advisory_burst: int = 0
    max_inflight: int = 0  # a tenant's requests from admission to the end of their answers
    max_queued: int = 0  # a tenant's requests held back by selective pushing
    # A tenant's share of the hold-back queue within a priority tier (tenants take turns by weight).
    weight: float = 1.0
    # One tenant's own values: "tenant:key=value,key=value" (keys as above), the rest as above. In
    # SYMPHONY_QUOTAS_TENANTS, a JSON list (a comma there would split the entry).
    tenants: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SymphonyConfig:
    home: str = ""  # state directory; empty: $SYMPHONY_HOME or ~/.cache/symphony
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    regions: RegionsConfig = field(default_factory=RegionsConfig)
    quotas: QuotasConfig = field(default_factory=QuotasConfig)

    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser()

    @staticmethod
    def node_id(index: int) -> str:
        return f"node-{index}"

    def node_grpc_address(self, index: int) -> str:
        """Where the cluster reaches node `index`'s gRPC (its membership and the schedulers' node
        list say this): the advertised address when set (`node.advertise_*`), else where it listens."""
        n = self.node
        port = n.advertise_grpc_port_base + index if n.advertise_grpc_port_base else n.grpc_port_base + index
        return f"{self.advertised_host}:{port}"

    def node_grpc_listen(self, index: int) -> str:
        """Where node `index`'s gRPC listens (its own host, and the launcher's probes, dial it here)."""
        return f"{self.node.host}:{self.node.grpc_port_base + index}"

    @property
    def advertised_host(self) -> str:
        return self.node.advertise_host or self.node.host

    def engine_port(self, index: int) -> int:
        return self.node.engine_port_base + index

    def engine_advertised_url(self, index: int) -> str:
        """Where the schedulers send node `index`'s engine requests (`node.advertise_*`)."""
        n = self.node
        port = n.advertise_engine_port_base + index if n.advertise_engine_port_base else self.engine_port(index)
        return f"http://{self.advertised_host}:{port}"

    def kv_advertised_data_port(self, index: int, listening: int) -> int:
        """The page stream's port that peers dial for node `index`, which listens on `listening`."""
        return self.node.advertise_data_port_base + index if self.node.advertise_data_port_base else listening

    def kv_metrics_port(self, index: int) -> int:
        return self.kv.metrics_port_base + index if self.kv.metrics_port_base else 0

    def kv_socket_path(self, index: int) -> Path:
        """The node-local KV channel (Unix socket) between node manager `index` and its engine's
        connector. Under the temp directory, not the home: socket paths are limited to 107 bytes.
        Named by user and gRPC port, like the DRAM arena: unique per running node on this host."""
        return (
            Path(tempfile.gettempdir()) / f"symphony-{os.getuid()}-{self.node_id(index)}-"
            f"{self.node.grpc_port_base + index}.sock"
        )

    def engine_events_endpoint(self, index: int) -> str:
        """Where node `index`'s engine publishes its KV events (ZMQ PUB, which vLLM binds): an ipc
        socket named like the KV channel, so private to this user and unique per running node on this
        host, with no TCP port to collide between two local clusters. vLLM's publisher keeps an ipc
        endpoint as given for data-parallel rank 0, the only rank a node's engine has."""
        return f"ipc://{self.kv_socket_path(index).with_suffix('.events')}"

    def kv_data_port(self, index: int) -> int:
        """The page stream's port for node `index`; 0: any free one."""
        return self.kv.data_port_base + index if self.kv.data_port_base else 0

    def kv_ssd_dir(self, index: int) -> Path:
        base = Path(self.kv.ssd_dir).expanduser() if self.kv.ssd_dir else self.home_path / "kv"
        return base / self.node_id(index)

    @property
    def cost_profile_path(self) -> Path:
        return (
            Path(self.scheduler.cost_profile).expanduser()
            if self.scheduler.cost_profile
            else (self.home_path / "cost-profile.json")
        )

    def scheduler_node_addresses(self) -> list[str]:
        """The nodes a scheduler starts with: scheduler.node_addresses, else the local cluster's (its
        region's), else, with a coordination store (cluster.etcd_endpoints), none: the members
        registered there join as they come."""
        if self.scheduler.node_addresses:
            return list(self.scheduler.node_addresses)
        if self.cluster.etcd_endpoints:
            return []
        topology = self.topology()
        if topology is not None and self.scheduler.region:
            return [self.node_grpc_address(i) for i in topology.region(self.scheduler.region).nodes]
        return [self.node_grpc_address(i) for i in range(self.cluster.nodes)]

    @property
    def scheduler_listen_port(self) -> int:
        """Where this scheduler listens: scheduler.port, or its region's port in a multi-region cluster."""
        topology = self.topology()
        if topology is not None and self.scheduler.region:
            return self.regions.scheduler_port_base + topology.region(self.scheduler.region).index
        return self.scheduler.port

    @property
    def scheduler_url(self) -> str:
        return f"http://{self.scheduler.host}:{self.scheduler.port}"

    def topology(self) -> RegionTopology | None:
        """The regions `[regions]` describes; None for a one-region cluster. ValueError as
        load_config reports it (it has built this once)."""
        r = self.regions
        if not r.layout:
            return None
        return build_topology(
            r.layout, r.links, r.intra_rtt_ms, r.residency, links_are_default=r.links == list(DEFAULT_WAN_LINKS)
        )
