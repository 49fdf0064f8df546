"""What an entry knows of the sessions each region holds: the region's feed (scheduler.region_feed)
applied delta by delta. Bounded (least recently changed out), single-threaded (the entry's loop)."""

from __future__ import annotations

from collections import OrderedDict

from symphony.region_load import MAX_DELTA_SESSIONS, SessionDelta


class HeldSessions:
    def __init__(self, max_sessions: int = MAX_DELTA_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self.epoch = ""  # of the feed followed; "" before the first delta
        self.seq = 0  # where the next read resumes
        self._tokens: OrderedDict[str, tuple[int, str]] = OrderedDict()  # digest -> (tokens held, node)

    def __len__(self) -> int:
        return len(self._tokens)

    def apply(self, delta: SessionDelta) -> None:
        if delta.reset:
            self._tokens.clear()
        for digest, tokens, node in delta.held:
            if tokens:
                self._tokens[digest] = (tokens, node)
                self._tokens.move_to_end(digest)
            else:
                self._tokens.pop(digest, None)
        while len(self._tokens) > self.max_sessions:
            self._tokens.popitem(last=False)
        self.epoch, self.seq = delta.epoch, delta.seq

    def tokens(self, digest: str) -> int:
        return self._tokens.get(digest, (0, ""))[0]

    def holder(self, digest: str) -> str:
        """The node holding the most of the session ("" when none does)."""
        return self._tokens.get(digest, (0, ""))[1]
