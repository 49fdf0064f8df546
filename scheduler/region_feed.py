"""The feed of sessions whose KV this region holds, for the global layer of a multi-region cluster
(`GET /summary?since=SEQ`, symphony.region_load.SessionDelta).

Fed by the session table (`SessionTable(on_change=feed.changed)`) with each session's tokens held
in the region (its best node's copy), named by digest. Bounded: one entry per session, at most
`max_sessions` (the least recently changed are dropped, and a reader whose `since` is older than
what was dropped gets a reset with everything retained). Single-threaded (the scheduler's loop).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

from symphony.region_load import MAX_DELTA_SESSIONS, SessionDelta, session_digest


class SessionFeed:
    def __init__(self, max_sessions: int = MAX_DELTA_SESSIONS) -> None:
        if not 0 < max_sessions <= MAX_DELTA_SESSIONS:
            raise ValueError(f"max_sessions must be within 1..{MAX_DELTA_SESSIONS}")
        self.max_sessions = max_sessions
        self.epoch = secrets.token_hex(8)  # this feed's: a reader of another (a restart) starts over
        self.seq = 0  # of the latest change
        self.floor = 0  # changes up to this seq may have been dropped
        # digest -> (seq, tokens, node holding them), by seq
        self._entries: OrderedDict[str, tuple[int, int, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def changed(self, key: tuple[str, str], tokens: int, node: str) -> None:
        """Session `key` (tenant, id) now has `tokens` of KV in the region (0: none), the most on
        `node`."""
        digest = session_digest(*key)
        held = self._entries.get(digest)
        if held is not None and held[1:] == (tokens, node):
            return
        self.seq += 1
        self._entries[digest] = (self.seq, tokens, node)
        self._entries.move_to_end(digest)
        while len(self._entries) > self.max_sessions:
            _, (dropped_seq, _, _) = self._entries.popitem(last=False)
            self.floor = dropped_seq

    def since(self, seq: int, epoch: str) -> SessionDelta:
        """The changes after `seq` (a reader's last `SessionDelta.seq` of this `epoch`; 0 at first)."""
        if epoch != self.epoch or seq < self.floor or seq > self.seq:  # another feed, or too far behind
            held = tuple((d, t, n) for d, (_, t, n) in self._entries.items() if t)
            return SessionDelta(self.epoch, self.seq, True, held)
        changes = []
        for digest, (changed_at, tokens, node) in reversed(self._entries.items()):
            if changed_at <= seq:
                break
            changes.append((digest, tokens, node))
        changes.reverse()
        return SessionDelta(self.epoch, self.seq, False, tuple(changes))
