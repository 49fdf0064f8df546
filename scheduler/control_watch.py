"""Other replicas' admin changes, from etcd (cluster.etcd_endpoints): a thread watches this
scheduler's control entries (symphony.control_etcd) from the revision its state was restored at,
and hands each change to the event loop, where `SchedulerControl.apply` applies it.

Contracts:
- Nothing is missed: the watch starts at the restore's revision + 1, and each new watch resumes
  after the last revision handed over. A watch whose revision was compacted (or that etcd
  refused) reads a snapshot again and hands over its difference with what had been handed over
  (an entry gone is handed over as deleted).
- etcd unreachable: the changes applied stay; the thread retries (1 s, doubling to 10 s), logging
  when reads start failing and when they are back.
- Reads have deadlines: a watch silent for IDLE_S ends and is made again.
- Bounded: what it remembers (`values`, to tell what a snapshot changed) is the store's entries,
  which a snapshot refuses past the store's `max_entries`.
- A daemon thread; `stop` sets its flag, and it ends at its next message or idle deadline (or
  at once, when the store's client is closed under it).
- This replica's own writes come back as events too; they are not applied again
  (`EtcdControlStore.is_echo`), so that an echo never undoes a later change of this replica.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from symphony.control_etcd import EtcdControlStore, TenantEntry
from symphony.control_state import Changed, SessionPriority
from symphony.etcd_client import EtcdError, EtcdUnavailable, WatchEvent
from symphony.logs import get_logger

log = get_logger(__name__)

IDLE_S = 10.0  # a watch with no message for this long is made again
BACKOFF_S = (1.0, 10.0)  # first and longest wait between failed watches

Apply = Callable[[Changed, TenantEntry | SessionPriority | None], None]


class ControlWatch:
    def __init__(self, store: EtcdControlStore, apply: Apply) -> None:
        self.store = store
        self._apply = apply  # runs on the event loop
        self.values = dict(store.values)  # key -> value handed over last (the thread's own)
        self.revision = store.revision  # the last revision handed over
        self.handed = 0  # changes handed to the loop
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="control-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        backoff, failing = BACKOFF_S[0], False
        while not self._stop.is_set():
            try:
                for event in self.store.client.watch(self.store.prefix, self.revision + 1, IDLE_S):
                    if self._stop.is_set():
                        return
                    self._hand(event.key, event.value, event)
                    self.revision = max(self.revision, event.mod_revision)
                if failing:
                    log.info("control watch: etcd answers again")
                backoff, failing = BACKOFF_S[0], False
            except EtcdUnavailable as exc:
                if not failing:
                    log.warning("control watch: etcd unreachable; other replicas' changes wait", error=str(exc))
                failing = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])
            except EtcdError as exc:  # compacted or refused: start again from a snapshot
                log.warning("control watch: reading the control state again", reason=str(exc))
                try:
                    self._resync()
                except EtcdError as again:
                    log.warning("control watch: snapshot failed", error=str(again))
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, BACKOFF_S[1])
            except Exception:  # a bug must not end the watch for good (nor a client closed at stop)
                if self._stop.is_set():
                    return
                log.exception("control watch failed")
                self._stop.wait(BACKOFF_S[1])

    def _resync(self) -> None:
        entries, revision = self.store.client.snapshot(self.store.prefix, self.store.max_entries)
        now = {entry.key: entry.value for entry in entries}
        for key, value in list(self.values.items()):
            if key not in now:
                self._hand(key, None, WatchEvent(key, None, value, revision))
        for key, value in now.items():
            if self.values.get(key) != value:
                self._hand(key, value, WatchEvent(key, value, self.values.get(key), revision))
        self.revision = revision

    def _hand(self, key: bytes, value: bytes | None, event: WatchEvent) -> None:
        if value is None:
            self.values.pop(key, None)
        else:
            self.values[key] = value
        if self._stop.is_set() or self.store.is_echo(key, event.mod_revision):
            return  # this replica's own write: its state has it, or a later change of its own
        try:
            changed, entry = self.store.decode_event(event)
        except ValueError as exc:
            log.warning("control entry skipped", key=key.decode(errors="replace"), error=str(exc))
            return
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._apply, changed, entry)
        except RuntimeError:  # the loop closed: the scheduler is stopping
            self._stop.set()
            return
        self.handed += 1
