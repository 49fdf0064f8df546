"""Admission of requests that would wait for a node (overload control), shared by the scheduler
(`scheduler.dispatch`) and the simulator (`eval.sim.cluster`).

A request that finds every node's engine with requests waiting is held back in the scheduler
(`scheduler.held_queue`) until a running request ends. Under open-loop load past capacity that
queue grows without end: every request waits up to `scheduler.queue_timeout_s` and many then fail,
so latency collapses and the work done for the ones that time out is wasted. Instead a newcomer
whose expected wait exceeds `scheduler.max_queue_wait_s` is refused at once (503 with
Retry-After), and the requests admitted wait at most about that long.

The expected wait is the time for the `ahead + 1` requests that must end before it starts (each
start takes the slot a running request frees) to end, at `slots_per_s` (`SlotRate`):
- Requests have been held back for a whole finish window (5 s): the rate requests ended since
  they were first held back, up to HELD_WINDOW_MS (`symphony.finish_rate`). The nodes were full
  all along, so it is their capacity. Over the hold, not just the last 5 s: an engine's batch
  often ends together (requests of one length, started together), so the finishes come in bursts
  a batch's time apart, and a 5 s count swung from 0 to 16 between two bursts (0.2 to 3 a second
  for a cluster serving 1.8), refusing on a lull and admitting on a burst.
- Before that (a burst after a quiet spell): the larger of that rate and Little's law, the
  requests on engines now over their mean time there (`SlotTime`). The recent finish rate is then
  the past demand, not the capacity, and would refuse a burst the nodes serve quickly; Little's
  law, from slot times of requests that ran in smaller batches, errs the other way, towards
  admitting, until the window fills. A stalled cluster (nothing ends) is admitted meanwhile, and
  `queue_timeout_s` bounds that wait as it did before. With neither (nothing ever ended): admitted.

Each scheduler replica prices the wait with its own counts (its requests, its finishes), which
is right when the replicas share the load about evenly; one that sends little while another
floods the same engines sees a low finish rate, and refuses sooner than it need.

`ahead` is the held-back queue's count for the newcomer's tier and tenant (`HeldQueue.ahead`), so
a tenant flooding the queue is refused while another tenant, whose turns interleave with its
requests rather than following them, is still admitted.

Pure: no I/O, no clocks; the caller passes the time (milliseconds on its own monotonic clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from symphony.finish_rate import FinishRate

__all__ = ["MAX_RETRY_AFTER_S", "Admission", "Overloaded", "SlotRate", "SlotTime", "admit"]

MAX_RETRY_AFTER_S = 3600  # Retry-After is capped here (a stalled estimate must not ask for a day)
SLOT_TIME_WEIGHT = 0.1  # the exponential average's weight for each new request (~the last 20)
HELD_WINDOW_MS = 30_000.0  # a hold's finish rate counts its last 30 s at most (1 s buckets)


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    wait_s: float | None  # the expected wait; None: no estimate (nothing has ended yet)
    retry_after_s: int = 0  # refused: when the queue ahead should be short enough, at this rate


class Overloaded(Exception):
    """A newcomer refused by `admit` (`scheduler.held_queue.HeldQueue.push`)."""

    def __init__(self, wait_s: float, retry_after_s: int) -> None:
        super().__init__(f"it would wait about {wait_s:.0f} s for a node; retry in {retry_after_s} s")
        self.wait_s = wait_s
        self.retry_after_s = retry_after_s


def admit(ahead: int, slots_per_s: float, max_wait_s: float) -> Admission:
    """Admit a newcomer with `ahead` requests held back before it, slots freeing at `slots_per_s`
    (0: not known), when it would wait at most `max_wait_s` seconds. A refused one is told to retry
    when, with no newcomers, enough of those ahead will have started: at least 1 s (RFC 9110's
    whole seconds), at most MAX_RETRY_AFTER_S."""
    if ahead < 0 or max_wait_s < 0:
        raise ValueError(f"ahead {ahead}, max_wait_s {max_wait_s}")
    if not slots_per_s > 0:
        return Admission(True, None)
    wait_s = (ahead + 1) / slots_per_s
    if wait_s <= max_wait_s:
        return Admission(True, wait_s)
    retry = min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait_s - max_wait_s)))
    return Admission(False, wait_s, retry)


class SlotTime:
    """The mean time a request holds its engine slot (sent to ended, ms), as an exponential
    average; None before any ended. Not thread-safe: one owner."""

    def __init__(self, weight: float = SLOT_TIME_WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight {weight} is not in (0, 1]")
        self.weight = weight
        self.mean_ms: float | None = None

    def ended(self, held_ms: float) -> None:
        held_ms = max(0.0, held_ms)
        self.mean_ms = held_ms if self.mean_ms is None else self.mean_ms + self.weight * (held_ms - self.mean_ms)


class SlotRate:
    """How fast engine slots free up: the recent finish rate once requests have been held back for
    a whole window, else the larger of it and Little's law (see the module's contract). Not
    thread-safe."""

    def __init__(self, finishes: FinishRate | None = None, slot_time: SlotTime | None = None) -> None:
        self.finishes = finishes if finishes is not None else FinishRate()
        self.slot_time = slot_time if slot_time is not None else SlotTime()
        self.held_finishes = FinishRate(HELD_WINDOW_MS, round(HELD_WINDOW_MS / 1000))
        self._held_since_ms: float | None = None  # requests held back at every call since then
        self._last_call_ms: float | None = None

    def ended(self, now_ms: float, held_ms: float) -> None:
        """A request that reached an engine ended at `now_ms`, having held its slot `held_ms`."""
        self.finishes.finished(now_ms)
        self.held_finishes.finished(now_ms)
        self.slot_time.ended(held_ms)

    def per_s(self, now_ms: float, running: int, held: int) -> float:
        """Slots freed per second with `running` requests on engines and `held` held back now (a
        newcomer's own not counted: 0 when it is the first); 0: not known. Held back "all along"
        needs calls at most a window apart: with none for a window (no newcomer had to wait),
        the queue may have drained meanwhile, and its next burst starts a new span."""
        quiet = self._last_call_ms is None or now_ms - self._last_call_ms > self.finishes.window_ms
        self._last_call_ms = now_ms
        if held <= 0 or quiet:
            self._held_since_ms = None
        if held > 0 and self._held_since_ms is None:
            self._held_since_ms = now_ms
        if self._held_since_ms is not None and now_ms - self._held_since_ms >= self.finishes.window_ms:
            return self.held_finishes.per_s(now_ms, since_ms=self._held_since_ms)
        recent = self.finishes.per_s(now_ms)
        mean_ms = self.slot_time.mean_ms
        little = running * 1000.0 / mean_ms if mean_ms and running > 0 else 0.0
        return max(recent, little)
