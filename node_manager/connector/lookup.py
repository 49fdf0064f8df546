"""The connector's scheduler side of "how much of this history can the node's tiers load?".

vLLM asks once per new request, inside its scheduling step, so the answer must not wait on another
process: the request's block keys are computed here (the chained hash every process shares,
`symphony.kv_addressing`) and looked up in the node manager's shared-memory block index
(`node_manager.kv.block_index`), one block at a time, stopping at the first the tiers lack, so a new
turn hashes only what it could load, and a session's keys from its last turn are reused.

The history itself must reach the node manager before the request's loads and saves, which address
the session's blocks. Sent during the match, it cost the match a wake-up of a node manager thread
that often ran on the sender's CPU first (p90 1 ms, p99 2-5 ms for a 2,048-token history); so the
matches of a scheduler step queue their registrations and `send_registrations` sends them in one
write when the step's plan is built, before any worker loads or saves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from node_manager.connector.kv_client import NodeKVClient, registration_frame
from node_manager.kv.block_index import BlockIndexReader
from symphony.kv_addressing import (
    BlockKey,
    ModelFingerprint,
    keys_after,
    tail_key,
    tail_length,
    tail_mark,
    tail_mark_of,
    tenant_root,
    token_array,
)

# Recent sessions whose held blocks' keys are kept, so a resumed turn hashes only its new blocks;
# bounded in tokens (4 bytes each, plus 32 bytes of key per block) as well as in sessions.
MAX_SESSIONS = 4096
MAX_KEPT_TOKENS = 4 << 20
# Registrations queued between two sends; one step schedules at most max_num_seqs new requests, so
# this is reached only if nobody calls `send_registrations` (then the match sends them itself).
MAX_UNSENT_REGISTRATIONS = 1024


@dataclass(frozen=True, slots=True)
class HeldHistory:
    """The leading blocks of a request's history that the tiers hold in every layer, with their keys
    (a load names its last block's key, so it cannot be served another history's pages). With
    `tail_tokens` > 0 the last of them is a partial block of that many tokens (an earlier turn that
    ended mid-block, `tail_key`): `blocks` counts it."""

    blocks: int
    keys: tuple[BlockKey, ...]
    tail_tokens: int = 0


class HistoryLookup:
    """One per scheduler-side connector; not thread-safe (vLLM's scheduler runs on one thread)."""

    def __init__(
        self,
        client: NodeKVClient,
        model: ModelFingerprint,
        max_sessions: int = MAX_SESSIONS,
        max_kept_tokens: int = MAX_KEPT_TOKENS,
    ) -> None:
        """`model`: the fingerprint of the model this engine serves; histories are keyed under it,
        and a node manager that stores another model's KV is refused at `attach`."""
        self._client = client
        self._model = model
        self._max_sessions = max_sessions
        self._max_kept_tokens = max_kept_tokens
        # session -> (the tokens of its held blocks when last asked, their keys)
        self._sessions: OrderedDict[tuple[str, str], tuple[np.ndarray, tuple[BlockKey, ...]]] = OrderedDict()
        self._kept_tokens = 0
        self._index: BlockIndexReader | None = None
        self._block_size = 0
        self._attached_connection = -1  # the client connection whose hello named the index
        # What signs requests' kv_transfer_params (`symphony.kv_transfer`), from the hello.
        self.params_key: bytes | None = None
        self._unsent: list[bytes] = []  # registration frames not sent yet (`send_registrations`)

    def match(
        self, tenant: str, session: str, token_ids: Sequence[int] | np.ndarray, warmup: bool = False
    ) -> HeldHistory:
        """Register the history with the node manager and look up how much of it the tiers hold.
        Raises OSError (or KVChannelError) when the node manager cannot be reached."""
        tokens = token_array(token_ids)
        index = self.attach()
        self._unsent.append(registration_frame(tenant, session, tokens, warmup))
        if len(self._unsent) >= MAX_UNSENT_REGISTRATIONS:
            self.send_registrations()
        known = self._known_keys(tenant, session, tokens)
        held = list(known[: index.leading(known)])
        if len(held) == len(known):
            # Each new block is looked up as soon as it is hashed, up to the first the index lacks:
            # no block past what the tiers could load is hashed, and a held one costs a slot read.
            holds = index.holds
            for key in keys_after(self._model, tenant, tokens, self._block_size, held):
                if not holds(key):
                    break
                held.append(key)
        self._remember(tenant, session, tokens[: len(held) * self._block_size], tuple(held))
        tail, tail_key = self._held_tail(index, tenant, tokens, held)
        if tail_key is not None:
            return HeldHistory(len(held) + 1, (*held, tail_key), tail)
        return HeldHistory(len(held), tuple(held))

    def _held_tail(
        self, index: BlockIndexReader, tenant: str, tokens: np.ndarray, held: list[BlockKey]
    ) -> tuple[int, BlockKey | None]:
        """The longest partial block right after the held full blocks that the tiers hold, as
        (tokens, key), (0, None) if none. The earlier turn's tail length is not known here; the
        index lists the lengths held after the last full block in one probe (`tail_key`'s layout),
        and each, longest first, is confirmed by hashing that many tokens (one, almost always)."""
        start = len(held) * self._block_size
        longest = min(self._block_size - 1, len(tokens) - start)
        if longest <= 0:
            return 0, None
        parent = held[-1] if held else tenant_root(self._model, tenant)
        mark = tail_mark(parent)
        lengths = {tail_length(fp) for fp in index.run_at_home_of(mark) if tail_mark_of(fp) == mark}
        for length in sorted((n for n in lengths if 0 < n <= longest), reverse=True):
            key = tail_key(parent, tokens[start : start + length])
            if index.holds(key):
                return length, key
        return 0, None

    def send_registrations(self) -> None:
        """Send the registrations queued by `match` since the last call, in one write. Raises
        OSError if the node manager cannot be reached: those registrations are dropped (their
        requests' loads will fail and recompute), and the next match asks the node manager again
        before it trusts the index."""
        if not self._unsent:
            return
        frames = b"".join(self._unsent)
        self._unsent.clear()
        try:
            self._client.send_frames(frames)
        except OSError:
            self._attached_connection = -1
            raise

    def attach(self) -> BlockIndexReader:
        """The index of the node manager the client is connected to, mapped now if it is not yet:
        again after a reconnect, a failed send, or when the index file was replaced (the node
        manager closed or restarted). Raises OtherModelError when the node manager stores another
        model's KV than this engine serves."""
        if self._index is None or self._attached_connection != self._client.connections or self._index.replaced():
            hello = self._client.hello()
            check_hello_model(hello, self._model)
            self.close()
            self._index = BlockIndexReader(hello["block_index"])
            self._block_size = int(hello["block_size"])
            self.params_key = bytes.fromhex(str(hello.get("params_key", ""))) or None  # empty: none to check with
            self._attached_connection = self._client.connections
            self._sessions.clear()  # keyed under the old block size, possibly
            self._kept_tokens = 0
        return self._index

    def _known_keys(self, tenant: str, session: str, tokens: np.ndarray) -> tuple[BlockKey, ...]:
        """The keys kept from the session's last lookup, if its tokens then lead the tokens now."""
        known_tokens, keys = self._sessions.pop((tenant, session), (None, ()))
        if known_tokens is None:
            return ()
        self._kept_tokens -= len(known_tokens)
        return keys if np.array_equal(known_tokens, tokens[: len(known_tokens)]) else ()

    def _remember(self, tenant: str, session: str, tokens: np.ndarray, keys: tuple[BlockKey, ...]) -> None:
        self._sessions[(tenant, session)] = (tokens, keys)
        self._kept_tokens += len(tokens)
        while len(self._sessions) > self._max_sessions or self._kept_tokens > self._max_kept_tokens:
            dropped, _ = self._sessions.popitem(last=False)[1]
            self._kept_tokens -= len(dropped)

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None


class OtherModelError(ValueError):
    """The node manager stores another model's KV than this engine serves."""


def check_hello_model(hello: dict[str, object], model: ModelFingerprint) -> None:
    """Raise OtherModelError unless the node manager's hello names `model` as the one it stores KV of."""
    theirs = str(hello.get("model_fingerprint", ""))
    if theirs != model.hex():
        raise OtherModelError(
            f"the node manager stores KV of model {theirs[:12] or 'unknown'}, this engine "
            f"serves {model.hex()[:12]}: its tiers are not used"
        )
