"""Where a request's KV is, by content: what the `symphony` policy prices per node.

For a chat or completion request the locator takes its exact token ids (`TokenService`), keys their
full blocks as every node does (`symphony.kv_addressing`: a chain rooted in the model fingerprint and
the tenant, so another tenant's or another model's blocks never match), and asks the cluster KV index
which prefix of that chain each node holds, in which tiers. A system prompt that a thousand sessions
of the tenant share is found on whichever node computed it, for a session that never ran there.

Nodes the index is not current for (no events yet, a resync under way, a node that streams none)
keep the session table's hints (`hints_as_held`), so the answer degrades node by node rather than
all at once; without token ids (no tokenizer, an input it cannot reproduce, a busy tokenizer) the
request is routed on the hints alone. While the scheduler's tokenizer is still loading (seconds,
after a restart), an engine's `/tokenize` gives the ids (`scheduler.engine_tokens`). The locator
never fails a request.

The block keys of a session's last prompt are kept (bounded LRU by sessions), so a turn that extends
its history hashes only its new blocks.

Each block key also names a donor: a session whose prompt had it (bounded LRU by blocks,
`max_donor_blocks`). A node serves pages by session, so another session's copy of a shared prefix
moves between nodes only under its donor's name (`RouteRequest.prefix_donor`). The first session to
have a block stays its donor, its turn long finished when later ones ask, until it can give nothing:
no node has its copy any more (`RequestLocator`), or a pull of it failed (`donor_failed`); then the
next request with the block becomes its donor.

A donor also names a prefix being computed: a prompt is recorded when it is routed, its blocks reach
the index when the engine has computed them. A request whose prompt an earlier one shares further
than the index knows (`Located.pending_donor`) counts the earlier one's node as holding that prefix
(`with_pending`, as the session table's hints count a session's own turn once sent), so it queues
behind that prefill rather than compute the same prefix at once on another node; such a prefix is
never pulled (nothing is there yet). State is owned by the event loop's thread.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler.engine_tokens import engine_token_ids
from scheduler.kv_index import NodePrefix
from scheduler.metrics import SchedulerMetrics
from scheduler.node_monitor import NodeMonitor
from scheduler.routing import HeldPrefix, RouteRequest, hints_as_held
from scheduler.tokens import TokenService
from symphony.kv_addressing import BlockKey, ModelFingerprint, keys_after

SessionKey = tuple[str, str]
_MAX_FAILED_DONORS = 1024
# (tenant, session id, model fingerprint) -> node id -> the session's history tokens there, for
# copies of that model only (the session table's `kv_tokens`).
SessionCopies = Callable[[str, str, bytes], Mapping[str, int]]


@dataclass(frozen=True, slots=True)
class Located:
    """What routing gets: the prompt's exact length (0: unknown) and per node the prefix it holds
    (empty: the caller keeps the session table's hints for every node)."""

    prompt_tokens: int = 0
    held: Mapping[str, HeldPrefix] | None = None
    source: str = "hints"  # "index": some node was priced from the index; "hints": none was
    # Another session whose prompt had the longest prefix the index found (None: none known), that
    # prefix in tokens, and the key of its last block (what names the donor).
    donor: str | None = None
    donor_tokens: int = 0
    donor_key: BlockKey | None = None
    # A session whose prompt shared more of this one than the index found on any node (its turn still
    # in prefill, most likely: its blocks are not stored yet), and that prefix in tokens.
    pending_donor: str | None = None
    pending_tokens: int = 0


NOT_LOCATED = Located()


@dataclass(slots=True)
class _SessionKeys:
    model: ModelFingerprint
    block_size: int
    ids: np.ndarray
    keys: list[BlockKey]


def held_from_index(prefix: NodePrefix, block_size: int) -> HeldPrefix:
    """An index answer (blocks by fastest tier) in tokens."""
    return HeldPrefix(
        engine=prefix.engine * block_size,
        hbm=prefix.hbm * block_size,
        dram=prefix.dram * block_size,
        ssd=prefix.ssd * block_size,
    )


class KVLocator:
    """`prefix(keys)` answers from the cluster KV index (it may name nodes the index is not current
    for: `locate` takes its answer only for the nodes `synced(node)` says it is current for;
    `SchedulerState.kv_holders`, `kv_synced`)."""

    def __init__(
        self,
        prefix: Callable[[Sequence[BlockKey]], Mapping[str, NodePrefix]],
        synced: Callable[[str], bool],
        max_sessions: int,
        max_donor_blocks: int = 262_144,
    ) -> None:
        if max_sessions <= 0 or max_donor_blocks <= 0:
            raise ValueError("max_sessions and max_donor_blocks must be positive")
        self._prefix = prefix
        self._synced = synced
        self._max_sessions = max_sessions
        self._max_donor_blocks = max_donor_blocks
        self._sessions: OrderedDict[SessionKey, _SessionKeys] = OrderedDict()
        # Block key -> the session id of its donor (the key's chain names the tenant).
        self._donors: OrderedDict[BlockKey, str] = OrderedDict()
        # Donors a pull of which failed lately (bounded; oldest out): replaced when next asked for.
        self._failed: OrderedDict[str, None] = OrderedDict()
        self.keys_hashed = 0  # blocks hashed so far (the rest came from a session's previous turn)

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def donor_blocks(self) -> int:
        """Block keys with a donor session recorded."""
        return len(self._donors)

    def donor(self, key: BlockKey) -> str | None:
        """The donor of the block `key` (None: none recorded, or forgotten)."""
        return self._donors.get(key)

    def set_donor(self, key: BlockKey, session_id: str) -> None:
        """`session_id` becomes the donor of `key` (its donor could give nothing)."""
        self._donors[key] = session_id
        self._donors.move_to_end(key)

    def donor_failed(self, session_id: str) -> None:
        """A pull under `session_id`'s name failed (the node that had its copy evicted it, or forgot
        the session): the next request asking for a block it is the donor of replaces it."""
        self._failed[session_id] = None
        self._failed.move_to_end(session_id)
        while len(self._failed) > _MAX_FAILED_DONORS:
            self._failed.popitem(last=False)

    def in_engine(self, session: SessionKey, node: str) -> bool:
        """Whether the index, current for `node`, has the session's last prompt in `node`'s engine
        cache (under its tenant's salt): every full block, the last one aside (at most one block the
        next turn's prefill computes again). A move of the session's KV there would bring the
        engine next to nothing. False where unknown."""
        found = self._last_prompt_on(session, node)
        if found is None:
            return False
        last, prefix = found
        return prefix is not None and prefix.engine >= max(1, len(last.keys) - 1)

    def held_for_move(self, session: SessionKey, node: str, history: int) -> HeldPrefix | None:
        """The session's `history` tokens as `node` holds them, by tier: its last prompt's full blocks
        as the index, current for `node`, has them, the rest (its answer) in DRAM, where the
        connector saved it. None where unknown (no prompt seen, or the index not current)."""
        found = self._last_prompt_on(session, node)
        if found is None:
            return None
        last, prefix = found
        held = held_from_index(prefix, last.block_size) if prefix is not None else HeldPrefix()
        return held._replace(dram=held.dram + max(0, history - held.total))

    def _last_prompt_on(self, session: SessionKey, node: str) -> tuple[_SessionKeys, NodePrefix | None] | None:
        """The session's last prompt and the index's answer for it on `node` (None: it holds none of
        it); None where unknown (no prompt seen, or the index not current for `node`)."""
        last = self._sessions.get(session)
        if last is None or not last.keys or not self._synced(node):
            return None
        return last, self._prefix(last.keys).get(node)

    def block_keys(
        self,
        tenant: str,
        session_id: str | None,
        ids: np.ndarray,
        model: ModelFingerprint,
        block_size: int,
    ) -> list[BlockKey]:
        """The keys of the full blocks of `ids` (a '<u4' array) under `model` and `tenant`: those the
        session's previous prompt shares are reused, the rest hashed. The session becomes the donor
        of the blocks hashed."""
        keys, new = self._keys(tenant, session_id, ids, model, block_size)
        if session_id is not None:
            self._record_donor(session_id, new)
        return keys

    def _keys(
        self, tenant: str, session_id: str | None, ids: np.ndarray, model: ModelFingerprint, block_size: int
    ) -> tuple[list[BlockKey], list[BlockKey]]:
        """(`block_keys`, those of them hashed now); the session's prompt is kept for its next turn."""
        session = (tenant, session_id) if session_id is not None else None
        known: list[BlockKey] = []
        previous = self._sessions.get(session) if session is not None else None
        if previous is not None and previous.model == model and previous.block_size == block_size:
            same = min(len(previous.ids), len(ids))
            differ = np.flatnonzero(previous.ids[:same] != ids[:same])
            common = int(differ[0]) if len(differ) else same
            known = previous.keys[: common // block_size]
        new = list(keys_after(model, tenant, ids, block_size, known))
        self.keys_hashed += len(new)
        keys = known + new
        if session is not None:
            self._sessions[session] = _SessionKeys(model, block_size, ids, keys)
            self._sessions.move_to_end(session)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return keys, new

    def _record_donor(self, session_id: str, new: Sequence[BlockKey]) -> None:
        """`session_id`'s prompt has the blocks `new` (those hashed for it: the ones reused are its own
        from its previous turn, recorded then): it becomes the donor of those that have none, and
        every one of them counts as used (least recently used out)."""
        donors = self._donors
        for key in new:
            donors.setdefault(key, session_id)
            donors.move_to_end(key)
        while len(donors) > self._max_donor_blocks:
            donors.popitem(last=False)

    def locate(
        self,
        tenant: str,
        session_id: str | None,
        ids: np.ndarray | None,
        model: ModelFingerprint | None,
        block_size: int,
        nodes: Sequence[str],
        kv_tokens: Mapping[str, int],
    ) -> Located:
        """Per node of `nodes`: the index's answer where it is current, else the session table's
        hint (`kv_tokens`, node -> tokens). Without ids, a fingerprint or a block size: the hints."""
        if ids is None or model is None or block_size <= 0:
            return NOT_LOCATED
        keys, new = self._keys(tenant, session_id, ids, model, block_size)
        from_index = self._prefix(keys) if keys else {}
        hints = hints_as_held(kv_tokens)
        held: dict[str, HeldPrefix] = {}
        converted: dict[NodePrefix, HeldPrefix] = {}  # nodes holding the same prefix (a system prompt's)
        indexed = False
        longest = 0  # blocks: the longest prefix the index found on a node
        for node in nodes:
            if self._synced(node):
                indexed = True
                prefix = from_index.get(node)
                if prefix is not None and prefix.blocks:
                    tokens = converted.get(prefix)
                    if tokens is None:
                        tokens = converted[prefix] = held_from_index(prefix, block_size)
                    held[node] = tokens
                    longest = max(longest, prefix.blocks)
            elif node in hints:
                held[node] = hints[node]
        donor_key = keys[longest - 1] if longest else None
        donor = self._donors.get(donor_key) if donor_key is not None else None
        if donor_key is not None and donor in self._failed:
            del self._donors[donor_key]
            donor = None  # this request's session takes its place (below)
        if donor == session_id:
            donor = None  # the session's own copies are the session table's (`kv_tokens`)
        seen = self._seen_blocks(keys, longest)
        pending = self._donors.get(keys[seen - 1]) if seen > longest else None
        if pending == session_id or pending in self._failed:
            pending = None
        if session_id is not None:
            self._record_donor(session_id, new)  # after the lookups: a session is no donor of itself
        source = "index" if indexed else "hints"
        located = Located(len(ids), held, source)
        if donor is not None:
            located = dataclasses.replace(located, donor=donor, donor_tokens=longest * block_size, donor_key=donor_key)
        if pending is not None:
            located = dataclasses.replace(located, pending_donor=pending, pending_tokens=seen * block_size)
        return located

    def _seen_blocks(self, keys: Sequence[BlockKey], known: int) -> int:
        """The longest prefix of `keys`, in blocks and at least `known`, whose last block has a donor:
        some earlier prompt had it (a chained key names the whole prefix before it). A binary search,
        taking the recorded keys as closed under prefixes (a prompt records all its blocks; the
        bound drops its oldest, first ones, first, which at worst shortens the answer)."""
        low, high = known, len(keys)
        donors = self._donors
        while low < high:
            middle = (low + high + 1) // 2
            if keys[middle - 1] in donors:
                low = middle
            else:
                high = middle - 1
        return low


class RequestLocator:
    """The dispatcher's step before routing: a request's exact prompt and where its prefix is, per
    node serving its model (`KVLocator.locate`). Skipped where one node or none can serve it (there
    is nothing to choose between), and for bodies the tokenizer cannot reproduce (the request keeps
    the session table's hints)."""

    def __init__(
        self,
        tokens: TokenService,
        kv: KVLocator,
        cluster: NodeMonitor,
        metrics: SchedulerMetrics,
        engine_timeout_s: float = 1.0,
        session_copies: SessionCopies = lambda _tenant, _session, _fingerprint: {},
    ) -> None:
        self.tokens = tokens
        self.engine_timeout_s = engine_timeout_s  # an engine's /tokenize, while the tokenizer loads
        self.kv = kv
        self.cluster = cluster
        self.metrics = metrics
        self.session_copies = session_copies  # where a donor session's KV is (the session table)

    async def locate(self, request: RouteRequest, body: Mapping[str, Any]) -> RouteRequest:
        now = time.monotonic()
        nodes = [
            n
            for n in self.cluster.nodes
            if n.served_model == request.model and n.available(now, self.cluster.down_after_s)
        ]
        if len(nodes) < 2:
            self.metrics.kv_located.labels("skipped").inc()
            return request
        ids = await self.tokens.request_token_ids(request.tenant, request.session_id, request.model, body)
        if ids is None and self.tokens.status(request.model) == "loading":
            ids = await self._engine_ids(request.model, body)
        # Nodes of one served model share a fingerprint and block size (else no KV moves between
        # them, and the index holds none of the others' blocks under these keys).
        first = nodes[0]
        located = self.kv.locate(
            request.tenant,
            request.session_id,
            ids,
            ModelFingerprint(first.model_fingerprint) if first.model_fingerprint else None,
            first.block_size,
            [n.node_id for n in nodes],
            request.kv_tokens,
        )
        self.metrics.kv_located.labels(located.source if located.held is not None else "no_ids").inc()
        fingerprint = first.model_fingerprint
        routed = apply_located(
            request, located, lambda session: self.session_copies(request.tenant, session, fingerprint)
        )
        if located.donor_key is not None and routed.prefix_donor is None and request.session_id is not None:
            self.kv.set_donor(located.donor_key, request.session_id)  # no node has the donor's copy now
        return routed

    async def _engine_ids(self, model: str, body: Mapping[str, Any]) -> np.ndarray | None:
        """The ids from an engine's `/tokenize` (`scheduler.engine_tokens`), while the scheduler's
        own tokenizer loads: a restarted scheduler routes by content from its first request."""
        node = self.cluster.least_busy_engine(model)
        if node is None:
            ids = None
        else:
            ids = await engine_token_ids(
                node.engine_url, model, body, self.engine_timeout_s, self.cluster.engine_headers
            )
        self.metrics.token_ids_from_engine.labels("ok" if ids is not None else "none").inc()
        return ids


def apply_located(
    request: RouteRequest, located: Located, copies_of: Callable[[str], Mapping[str, int]]
) -> RouteRequest:
    """`request` as routing sees it after `KVLocator.locate`: `with_located`, then `with_donor` and
    `with_pending` (`copies_of(session id)`: the session table's copies of a session, same model
    only). The dispatcher's and `bench route`'s one way."""
    routed = with_donor(with_located(request, located), located, copies_of)
    if located.pending_donor is not None:
        routed = with_pending(routed, located, copies_of(located.pending_donor))
    return routed


def donor_copies(held: Mapping[str, HeldPrefix], prefix_tokens: int, copies: Mapping[str, int]) -> dict[str, int]:
    """Node id -> the tokens of a request's shared prefix (`prefix_tokens`) that a pull of the donor
    session from that node brings: the donor's copy there (`copies`, its session table entry), no
    more than the node holds of the prompt (`held`; a node holding none of it has lost the donor's
    copy, or never had it)."""
    found = {}
    for node, tokens in copies.items():
        here = held.get(node)
        if here is not None:
            movable = min(tokens, prefix_tokens, here.total)
            if movable > 0:
                found[node] = movable
    return found


def with_donor(request: RouteRequest, located: Located, copies_of: Callable[[str], Mapping[str, int]]) -> RouteRequest:
    """`request` with the donor session `located` found and what a pull of it brings from each node
    (`donor_copies`; `copies_of(session id)`: node -> its history tokens there, same model only);
    unchanged when there is no donor or no node has its copy any more."""
    if located.donor is None or located.held is None:
        return request
    copies = donor_copies(located.held, located.donor_tokens, copies_of(located.donor))
    if not copies:
        return request
    return dataclasses.replace(request, prefix_donor=located.donor, prefix_copies=copies)


def with_pending(request: RouteRequest, located: Located, copies: Mapping[str, int]) -> RouteRequest:
    """`request` with each node the pending donor was sent to (`copies`: the session table's, node ->
    its history tokens, same model only) counted as holding the prefix `located` says it shares
    (`pending_tokens`), in DRAM, where the connector saves it as the engine computes it; a node's
    own holding stands where it is longer. Only as held: `prefix_copies`, what a pull brings, are
    what nodes hold now."""
    if not copies or request.held is None:
        return request
    held = dict(request.held)
    for node, tokens in copies.items():
        here = held.get(node)
        hint = min(tokens, located.pending_tokens)
        if here is None:
            held[node] = HeldPrefix(dram=hint)
        elif hint > here.total:
            held[node] = here._replace(dram=here.dram + hint - here.total)
    return dataclasses.replace(request, held=held)


def with_located(request: RouteRequest, located: Located) -> RouteRequest:
    """`request` with the exact prompt size and the per-node prefixes `located` found; unchanged when
    it found nothing (no token ids: the session table's hints stand)."""
    if located.held is None:
        return request
    return dataclasses.replace(request, prompt_tokens=located.prompt_tokens, held=located.held)
