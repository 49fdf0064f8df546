"""One scheduler instance's state: its tables, node views, metrics and dispatcher, built from the
configuration. The HTTP surface (`scheduler.app`, `scheduler.hot_path`, `scheduler.admin`) reads and
changes it; nothing here knows HTTP."""

from __future__ import annotations

import time

from scheduler.advisories import AdvisoryTable
from scheduler.auth import Authenticator
from scheduler.dispatch import Dispatcher
from scheduler.metrics import SchedulerMetrics
from scheduler.node_monitor import NodeMonitor
from scheduler.policies import make_policy
from scheduler.priorities import PriorityTable
from scheduler.sessions import SessionTable
from symphony.config import SymphonyConfig


class SchedulerState:
    """Everything one scheduler instance owns; built from config, started and stopped by the app."""

    def __init__(self, config: SymphonyConfig) -> None:
        self.config = config
        sc = config.scheduler
        self.metrics = SchedulerMetrics()
        self.cluster = NodeMonitor(
            config.scheduler_node_addresses(),
            poll_interval_s=sc.poll_interval_ms / 1000,
            down_after_s=sc.node_down_after_ms / 1000,
        )
        self.advisories = AdvisoryTable(
            sc.max_advisories,
            sc.advisory_ttl_s,
            on_drop=lambda reason: self.metrics.advisories_dropped.labels(reason).inc(),
        )
        self.auth = Authenticator(sc.api_keys, sc.admin_token)
        self.sessions = SessionTable(sc.max_sessions, sc.session_ttl_s)
        self.priorities = PriorityTable(sc.max_priority_settings)
        self.dispatcher = Dispatcher(
            self.cluster,
            make_policy(sc.policy, sc),
            self.advisories,
            self.metrics,
            sc,
            sessions=self.sessions,
            priorities=self.priorities,
        )

    def export_gauges(self) -> None:
        """Refresh the gauges from live state; done when /metrics is scraped, not on every change."""
        now = time.monotonic()
        m = self.metrics
        self.advisories.purge(now)
        self.sessions.purge()
        m.advisories_pending.set(len(self.advisories))
        for node in self.cluster.nodes:
            if not node.reported:
                continue  # its id is not known yet; no series under a placeholder name
            m.node_up.labels(node.node_id).set(1 if node.available(now, self.cluster.down_after_s) else 0)
            m.node_load.labels(node.node_id).set(node.running + node.waiting)
            m.node_inflight.labels(node.node_id).set(node.inflight)
            m.node_kv_usage.labels(node.node_id).set(node.kv_usage)
            m.node_engine_restarts.labels(node.node_id).set(node.engine_restarts)

    async def start(self) -> None:
        await self.dispatcher.start()
        await self.cluster.start()

    async def stop(self) -> None:
        await self.cluster.stop()
        await self.dispatcher.stop()
