"""One scheduler instance's state: its tables, node views, metrics and dispatcher, built from the
configuration. The HTTP surface (`scheduler.app`, `scheduler.hot_path`, `scheduler.admin`) reads and
changes it; nothing here knows HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from scheduler.advisories import AdvisoryTable
from scheduler.auth import Authenticator
from scheduler.control import SchedulerControl, control_path
from scheduler.control_watch import ControlWatch
from scheduler.dispatch import Dispatcher
from scheduler.errors import ApiError
from scheduler.kv_index import ClusterKVIndex, NodePrefix
from scheduler.kv_locator import KVLocator, RequestLocator
from scheduler.kv_watch import KVWatch
from scheduler.membership_watch import MembershipWatch
from scheduler.metrics import SchedulerMetrics
from scheduler.node_monitor import NodeMonitor
from scheduler.policies import make_policy
from scheduler.priorities import PriorityTable
from scheduler.profile_loader import load_cost_profile
from scheduler.region_feed import SessionFeed
from scheduler.sessions import SessionTable
from scheduler.tokenizer_check import check_tokenizers
from scheduler.tokenizer_load import tokenizer_dirs
from scheduler.tokens import TokenService
from symphony.cluster_tls import cluster_tls
from symphony.config import KV_INDEX_MAX_NODES, SymphonyConfig
from symphony.control_etcd import EtcdControlStore, TenantEntry, control_scope
from symphony.control_state import Changed, ControlFile, ControlStore, SessionPriority
from symphony.etcd_client import EtcdClient
from symphony.kv_addressing import BlockKey
from symphony.logs import get_logger
from symphony.models import DEFAULT_MODEL_NAME
from symphony.region_links import remote_node_addresses
from symphony.region_load import MAX_DELTA_SESSIONS
from symphony.residency_rules import known_tenants
from symphony.tenancy import engine_headers, secret_check
from symphony.tenant_quotas import quotas_from_config

log = get_logger(__name__)

MAX_TENANTS = 10_000  # tenant entries a control state in etcd may hold, beside the session tiers


class SchedulerState:
    """Everything one scheduler instance owns; built from config, started and stopped by the app."""

    def _residency_check(self) -> Callable[[str], ApiError | None] | None:
        """A regional scheduler's refusal of tenants whose data may not enter its region (the
        global layer never sends them; this holds for whoever calls it directly)."""
        region = self.config.scheduler.region
        if self.topology is None or not region:
            return None

        def refuse(tenant: str) -> ApiError | None:
            topology = self.topology  # the rules as they are now (the admin API replaces them)
            assert topology is not None
            if topology.allowed(tenant, region):
                return None
            self.metrics.residency_refused.labels(tenant).inc()
            log.warning("residency refused a request", tenant=tenant, region=region)
            allowed = ", ".join(topology.allowed_regions(tenant))
            return ApiError(
                403, f"tenant {tenant!r} may not use region {region} (allowed: {allowed})", code="residency"
            )

        return refuse

    def _remote_nodes(self) -> dict[str, str]:
        """A regional scheduler's way to each node of the other regions: its WAN link listeners."""
        topology, region = self.config.topology(), self.config.scheduler.region
        if topology is None or not region:
            return {}
        return remote_node_addresses(self.config, topology, region)

    def __init__(self, config: SymphonyConfig) -> None:
        self.config = config
        # The regions, and the residency rules this scheduler holds now: the configuration's, as
        # the admin API replaced them since (scheduler.admin, symphony.residency_rules).
        self.topology = config.topology()
        sc = config.scheduler
        self.metrics = SchedulerMetrics()
        self.cluster = NodeMonitor(
            config.scheduler_node_addresses(),
            poll_interval_s=sc.poll_interval_ms / 1000,
            down_after_s=sc.node_down_after_ms / 1000,
            secret_check=secret_check(config.cluster.secret.encode()),
            tls=cluster_tls(config),
            engine_headers=engine_headers(config.cluster.secret),
            max_nodes=KV_INDEX_MAX_NODES,
            max_running=config.engine.max_running_set(),
        )
        self.advisories = AdvisoryTable(
            sc.max_advisories,
            sc.advisory_ttl_s,
            on_drop=lambda reason: self.metrics.advisories_dropped.labels(reason).inc(),
        )
        self.auth = Authenticator(
            sc.api_keys, sc.admin_token, self._residency_check(), secret=config.cluster.secret.encode()
        )
        # A region's scheduler tells the global layer which sessions it holds (scheduler.region_feed).
        self.region_feed = SessionFeed(min(sc.max_sessions, MAX_DELTA_SESSIONS)) if sc.region else None
        self.sessions = SessionTable(
            sc.max_sessions,
            sc.session_ttl_s,
            on_change=self.region_feed.changed if self.region_feed is not None else None,
        )
        self.priorities = PriorityTable(sc.max_priority_settings)
        if sc.api_keys and not config.cluster.secret:
            log.warning(
                "cluster.secret is empty: each tenant's engine cache salt is a digest of its name, which "
                "anyone who reaches an engine can compute (symphony up sets one; give every process the same)"
            )
        # Each tenant's rates, caps and share of the hold-back queue (checked by load_config).
        self.quotas = quotas_from_config(config.quotas, known_tenants(sc.api_keys))
        # The cluster KV index, fed by the nodes' block event streams; None when turned off.
        self.kv_index: ClusterKVIndex | None = None
        self.kv_watch: KVWatch | None = None
        if sc.kv_index_enabled:
            # Room for every node that may join when membership is followed; else for those given.
            slots = KV_INDEX_MAX_NODES if config.cluster.etcd_endpoints else max(1, len(self.cluster.nodes))
            self.kv_index = ClusterKVIndex(sc.kv_index_max_blocks, slots)
            self.kv_watch = KVWatch(
                self.cluster,
                self.kv_index,
                self.metrics,
                timeout_s=sc.kv_watch_timeout_ms / 1000,
                backoff_max_s=sc.kv_watch_backoff_max_ms / 1000,
            )
        self.tokens = TokenService(
            tokenizer_dirs(config),
            self.metrics,
            cache_sessions=sc.tokenizer_cache_sessions,
            cache_tokens=sc.tokenizer_cache_tokens,
            timeout_s=sc.tokenize_timeout_ms / 1000,
        )
        self.tokenizer_check: asyncio.Task[None] | None = None
        self.cost_profile = load_cost_profile(
            config.cost_profile_path,
            host=socket.gethostname(),
            model=config.engine.served_model_name or Path(config.engine.model).name or DEFAULT_MODEL_NAME,
            now_unix_s=time.time(),
            max_age_s=sc.cost_profile_max_age_days * 86400,
        )
        self.locator = RequestLocator(
            self.tokens,
            KVLocator(self.kv_holders, self.kv_synced, sc.tokenizer_cache_sessions, sc.prefix_donor_blocks),
            self.cluster,
            self.metrics,
            engine_timeout_s=sc.tokenize_timeout_ms / 1000,
            session_copies=self.session_copies,
        )
        self.dispatcher = Dispatcher(
            self.cluster,
            make_policy(sc.policy, sc, self.cost_profile.profile),
            self.advisories,
            self.metrics,
            sc,
            sessions=self.sessions,
            priorities=self.priorities,
            locator=self.locator,
            profile=self.cost_profile.profile,
            remote_nodes=self._remote_nodes(),
            quotas=self.quotas,
            salt_key=config.cluster.secret.encode(),
        )
        # The admin API's changes, kept across restarts (with etcd, shared by the replicas and
        # followed as they change); applied last, over the configuration.
        store: ControlStore = ControlFile(control_path(config))
        self.control_watch: ControlWatch | None = None
        if config.cluster.etcd_endpoints:
            store = EtcdControlStore(
                EtcdClient(config.cluster.etcd_endpoints),
                config.cluster.etcd_prefix,
                control_scope(sc.region),
                sc.max_priority_settings + MAX_TENANTS,
            )
        self.control = SchedulerControl(store)
        self.control.restore(self)
        if isinstance(store, EtcdControlStore):
            self.control_watch = ControlWatch(store, self._apply_control)
            self.control.writes = self.control_watch
        # With a coordination store, the nodes that registered there (scheduler.membership_watch).
        self.membership: MembershipWatch | None = None
        if config.cluster.etcd_endpoints:
            self.membership = MembershipWatch(
                EtcdClient(config.cluster.etcd_endpoints),
                config.cluster.etcd_prefix,
                sc.region,
                sc.membership_poll_ms / 1000,
                join=self.add_node,
                leave=self.remove_node,
                metrics=self.metrics,
                static=config.scheduler_node_addresses(),
            )

    def _apply_control(self, changed: Changed, entry: TenantEntry | SessionPriority | None) -> None:
        """Another replica's admin change, here: applied, and a tier raised to high lets its held
        requests go first, as the admin API does for a change made here."""
        self.control.apply(self, changed, entry)
        if entry is not None and entry.priority == "high":
            self.dispatcher.promote(changed.tenant, changed.session_id)

    def describe_coordination(self) -> dict[str, object] | None:
        """With etcd: its endpoints, the members joined through it, whether reading them fails, and
        how far the watch of admin changes has got (for /readyz and `symphony status`)."""
        if self.membership is None:
            return None
        watch = self.control_watch
        return {
            "etcd": list(self.config.cluster.etcd_endpoints),
            "members_joined": sorted(self.membership.joined),
            "membership_error": self.membership.failing,
            "control_revision": watch.revision if watch is not None else None,
            "control_changes_applied": watch.handed if watch is not None else 0,
        }

    async def add_node(self, address: str) -> bool:
        """Follow and route to the node manager at `address` (a member that registered). False
        when it is followed already or there is no room (the monitor's or the index's bound)."""
        view = self.cluster.join(address)
        if view is None:
            return False
        if self.kv_watch is not None:
            try:
                self.kv_watch.add(view)
            except ValueError as exc:  # the index is full: not followed at all, rather than half
                log.error("node not followed", address=address, error=str(exc))
                await self.cluster.leave(view)
                return False
        return True

    async def remove_node(self, address: str) -> None:
        """Stop following the node at `address` (its membership ended): no request goes there, its
        block stream ends, and neither the index nor the session table counts its copies."""
        view = self.cluster.at(address)
        if view is None:
            return
        if self.kv_watch is not None:
            await self.kv_watch.remove(view)  # before its channel closes under the stream
        await self.cluster.leave(view)
        self.sessions.forget_node(view.node_id)
        m = self.metrics  # its series go with it: a node that left is not a node that is up
        for gauge in (m.node_up, m.node_load, m.node_inflight, m.node_kv_usage, m.node_engine_restarts):
            with contextlib.suppress(KeyError):
                gauge.remove(view.node_id)

    def kv_prefix(self, keys: Sequence[BlockKey]) -> dict[str, NodePrefix]:
        """Per node whose index entries are in sync: how many leading blocks of `keys` (a request's
        block key chain, which names its tenant and model) it holds, in which fastest tiers. Nodes
        absent hold none or are in fallback (`kv_synced`); {} when the index is off."""
        return self.kv_watch.prefix(keys) if self.kv_watch is not None else {}

    def kv_holders(self, keys: Sequence[BlockKey]) -> dict[str, NodePrefix]:
        """`kv_prefix` for every node the index knows, current or not (callers check `kv_synced`;
        the locator does, node by node, so filtering here would ask every node twice)."""
        return self.kv_index.prefix(keys) if self.kv_index is not None else {}

    def session_copies(self, tenant: str, session_id: str, fingerprint: bytes) -> dict[str, int]:
        """Node id -> the session's history tokens there, as the session table knows them, when they
        are KV of the model `fingerprint` names ({} otherwise, or for a session it does not know)."""
        entry = self.sessions.get((tenant, session_id))
        if entry is None or entry.fingerprint != fingerprint:
            return {}
        return dict(entry.kv_tokens)

    def kv_synced(self, node_id: str) -> bool:
        """Whether the index is current for the node; False: use the session table's hints for it."""
        return self.kv_watch is not None and self.kv_watch.synced(node_id)

    def export_gauges(self) -> None:
        """Refresh the gauges from live state; done when /metrics is scraped, not on every change."""
        now = time.monotonic()
        m = self.metrics
        self.advisories.purge(now)
        self.sessions.purge()
        m.advisories_pending.set(len(self.advisories))
        m.tokenize_cache_sessions.set(self.tokens.cached_sessions)
        m.tokenize_cache_tokens.set(self.tokens.cached_tokens)
        for node in self.cluster.nodes:
            if not node.reported:
                continue  # its id is not known yet; no series under a placeholder name
            m.node_up.labels(node.node_id).set(1 if node.available(now, self.cluster.down_after_s) else 0)
            m.node_load.labels(node.node_id).set(node.running + node.waiting)
            m.node_inflight.labels(node.node_id).set(node.inflight)
            m.node_kv_usage.labels(node.node_id).set(node.kv_usage)
            m.node_engine_restarts.labels(node.node_id).set(node.engine_restarts)
        m.link_observed_ms_per_token.clear()  # the pairs observed now (a bounded table drops the oldest)
        for link in self.dispatcher.links.describe():
            m.link_observed_ms_per_token.labels(link.source, link.target).set(link.ms_per_token)
        if self.kv_watch is not None:
            self.kv_watch.export_gauges()

    async def start(self) -> None:
        self.tokens.start()  # in the background: the tokenizers load while the nodes come up
        await self.dispatcher.start()
        await self.cluster.start()
        if self.kv_watch is not None:
            await self.kv_watch.start()  # on the monitor's channels, open now
        if self.membership is not None:
            self.membership.start()
        if self.control_watch is not None:
            self.control_watch.start(asyncio.get_running_loop())
        if self.tokens.dirs:
            self.tokenizer_check = asyncio.create_task(check_tokenizers(self.tokens, self.cluster))

    async def stop(self) -> None:
        if self.control_watch is not None:
            self.control_watch.stop()
            await asyncio.to_thread(self.control_watch.store.client.close)  # ends a watch under way
        if self.membership is not None:
            await self.membership.stop()
        if self.tokenizer_check is not None:
            self.tokenizer_check.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.tokenizer_check
        if self.kv_watch is not None:
            await self.kv_watch.stop()  # before the channels close under it
        await self.cluster.stop()
        await self.dispatcher.stop()
        self.tokens.stop()
