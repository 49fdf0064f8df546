"""Other replicas' admin changes, from etcd (cluster.etcd_endpoints): a thread watches this
scheduler's control entries (symphony.control_etcd) from the revision its state was restored at,
and hands each change to the event loop, where it is applied (`SchedulerControl.apply`) in
revision order with this replica's own writes (`EntryOrder`).

Contracts:
- Nothing is missed: the watch starts at the restore's revision + 1, and each new watch resumes
  after the last revision handed over. A watch whose revision was compacted (or that etcd
  refused) reads a snapshot again and hands over its difference with what had been handed over
  (an entry gone is handed over as deleted).
- Per entry, the loop applies only what is newer than what this replica holds: a change older than
  one applied (its own write's echo, or another replica's write that lost to a later one) is
  dropped, and one that arrives while this replica is writing the same entry waits for that write,
  applied then only if etcd ordered it after the write. So every replica ends with etcd's last
  write of each entry.
- etcd unreachable: the changes applied stay; the thread retries (1 s, doubling to 10 s), logging
  when reads start failing and when they are back.
- Reads have deadlines: a watch silent for IDLE_S ends and is made again.
- Bounded: what it remembers (`values`, `EntryOrder`) is per stored entry, which a snapshot
  refuses past the store's `max_entries` (the order forgets everything past that many keys).
- A daemon thread; `stop` sets its flag, and it ends at its next message or idle deadline.
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

Entry = TenantEntry | SessionPriority | None
Apply = Callable[[Changed, Entry], None]


class EntryOrder:
    """Per control entry (its etcd key), the revision this replica's state holds and the writes of
    its own under way. Used on the event loop only."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self.applied: dict[bytes, int] = {}  # key -> revision of the change the state holds
        self.writing: dict[bytes, int] = {}  # key -> this replica's writes of it under way
        self.held: dict[bytes, tuple[int, Changed, Entry]] = {}  # key -> newest change that waits

    def arrived(self, key: bytes, revision: int, changed: Changed, entry: Entry) -> bool:
        """A change from the watch: True to apply it now."""
        if revision <= self.applied.get(key, 0):
            return False
        if key in self.writing:
            if revision > self.held.get(key, (0, changed, None))[0]:
                self.held[key] = (revision, changed, entry)
            return False
        self._hold(key, revision)
        return True

    def begin(self, key: bytes) -> None:
        """This replica is about to change the entry and write it."""
        self.writing[key] = self.writing.get(key, 0) + 1

    def end(self, key: bytes, revision: int) -> tuple[Changed, Entry] | None:
        """Its write ended, at `revision` (0: it failed): the change that waited, to apply now if
        etcd ordered it after the write."""
        self.writing[key] -= 1
        if self.writing[key]:
            return None
        del self.writing[key]
        self._hold(key, revision)
        waited = self.held.pop(key, None)
        if waited is None or waited[0] <= self.applied.get(key, 0):
            return None
        self._hold(key, waited[0])
        return waited[1], waited[2]

    def _hold(self, key: bytes, revision: int) -> None:
        if len(self.applied) >= self.max_keys and key not in self.applied:
            self.applied.clear()
        self.applied[key] = max(revision, self.applied.get(key, 0))


class ControlWatch:
    def __init__(self, store: EtcdControlStore, apply: Apply) -> None:
        self.store = store
        self._apply = apply  # runs on the event loop
        self.order = EntryOrder(store.max_entries)
        self.values = dict(store.values)  # key -> value handed over last (the thread's own)
        self.revision = store.revision  # the last revision handed over
        self.handed = 0  # changes applied from the watch
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        for key in store.values:  # the restored state holds the load's revision of each entry
            self.order.applied[key] = store.revision

    # -- on the event loop ------------------------------------------------------------------------
    def writing(self, changed: Changed) -> None:
        """This replica changes `changed`'s entry and is about to write it (`SchedulerControl.save`)."""
        self.order.begin(self.store.key_of(changed))

    def written(self, changed: Changed, revision: int) -> None:
        """... and the write ended at `revision` (0: it failed)."""
        waited = self.order.end(self.store.key_of(changed), revision)
        if waited is not None:
            self._apply(*waited)
            self.handed += 1

    def _arrive(self, key: bytes, revision: int, changed: Changed, entry: Entry) -> None:
        if self.order.arrived(key, revision, changed, entry):
            self._apply(changed, entry)
            self.handed += 1

    # -- the thread -------------------------------------------------------------------------------
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
        if self._stop.is_set():
            return
        try:
            changed, entry = self.store.decode_event(event)
        except ValueError as exc:
            log.warning("control entry skipped", key=key.decode(errors="replace"), error=str(exc))
            return
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._arrive, key, event.mod_revision, changed, entry)
        except RuntimeError:  # the loop closed: the scheduler is stopping
            self._stop.set()
