"""The connector's scheduler-side bookkeeping: which blocks each step loads and saves.

Pure logic over plain values (no vLLM types, no I/O), so it is tested directly and the vLLM adapter
only translates. Loads are synchronous: a resumed turn gets the leading blocks the node's tiers
hold, loaded layer by layer during the same step's forward; what follows is computed. Saves follow
computation: every block that becomes full in a step is saved in that step, from vLLM's cache into
the node's DRAM (then SSD), so the next turn finds it.

A turn rarely ends on a block boundary: its last, partial block (half a block on average, ~16
tokens of every turn with 32-token blocks) is saved once the request has finished, in the next
step (vLLM keeps the request's blocks until the worker reports the copy done), and the next turn
loads it as a load of its own (the worker copies it before the forward), so a turn may compute
from the middle of a block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Blocks first_block.. of a session go into vLLM blocks `block_ids` (same order); `last_key` is
    the block key of the last of them, so the node manager serves exactly this history's pages."""

    tenant: str
    session: str
    first_block: int
    block_ids: tuple[int, ...]
    last_key: bytes
    tail_tokens: int = 0  # > 0: the last block is a partial one of that many tokens (`tail_key`)


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """vLLM blocks `block_ids` hold blocks first_block.. of a session, whose tokens through the end
    of those blocks are `token_ids` (the node manager keys pages by them)."""

    tenant: str
    session: str
    first_block: int
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TailSave:
    """The partial last block of finished request `request_id`: vLLM frees its blocks only once the
    worker reports this save done (`get_finished`), whether the save succeeded or not."""

    request_id: str
    save: SaveSpec


@dataclass(slots=True)
class StepPlan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    tail_saves: list[TailSave] = field(default_factory=list)


@dataclass(slots=True)
class RequestKV:
    tenant: str
    session: str
    held_keys: tuple[bytes, ...] | None = None  # keys of the leading blocks the tiers hold (looked up once)
    held_tail: int = 0  # > 0: the last held block is a partial one of that many tokens
    local_tokens: int = 0  # vLLM's own prefix-cache hit when it last asked
    pending_load: tuple[int, int] | None = None  # (first block, count) allocated, not yet planned
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # leading blocks the node manager has (loaded from it or saved to it)
    accounted: bool = False  # its prompt's token sources were counted (once, at first admission)
    # The node manager's engine warm-up of a prefetched session: it loads the history and saves
    # nothing (the tiers have it all), and is no user's prompt in the token-source counts.
    warmup: bool = False
    tiers: bool = True  # False: kept off Symphony's tiers (it neither loads nor saves)

    @property
    def held_blocks(self) -> int:
        return len(self.held_keys or ())

    @property
    def held_full_blocks(self) -> int:
        return self.held_blocks - (1 if self.held_tail else 0)

    def held_tokens(self, block_size: int) -> int:
        return self.held_full_blocks * block_size + self.held_tail


def external_tokens(held_tokens: int, local_tokens: int, num_tokens: int) -> int:
    """Tokens to load beyond vLLM's own hit, never the last token, which vLLM must compute to
    produce the next one. The count may end mid-block: vLLM computes the rest of that block into
    the loaded page's unused slots (which attention never reads past the sequence's length)."""
    return max(0, min(held_tokens, num_tokens - 1) - local_tokens)


class ConnectorPlanner:
    def __init__(self, block_size: int, max_requests: int = 65_536) -> None:
        self.block_size = block_size
        self.max_requests = max_requests
        self.requests: dict[str, RequestKV] = {}
        self._tail_saves: list[TailSave] = []  # finished requests' tails, for the next step

    def track(self, request_id: str, tenant: str, session: str, warmup: bool = False, tiers: bool = True) -> RequestKV:
        state = self.requests.get(request_id)
        if state is None:
            if len(self.requests) >= self.max_requests:
                # Bounded: requests vLLM never finished (it always does) must not grow this forever.
                self.requests.pop(next(iter(self.requests)))
            state = self.requests[request_id] = RequestKV(tenant, session, warmup=warmup, tiers=tiers)
        return state

    def matched(self, state: RequestKV, local_tokens: int, num_tokens: int) -> int:
        state.local_tokens = local_tokens
        state.saved_blocks = max(state.saved_blocks, state.held_full_blocks)  # the store has these already
        return external_tokens(state.held_tokens(self.block_size), local_tokens, num_tokens)

    def allocated(
        self, request_id: str, block_ids: Sequence[int], external: int, prompt_tokens: int
    ) -> dict[str, int] | None:
        """Record the blocks vLLM gave the request and the load they receive. The first time, also
        return where its prompt's KV comes from (tokens per source) for the node's metrics."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        state.block_ids = list(block_ids)
        if external > 0:
            first = state.local_tokens // self.block_size  # vLLM's own hits are whole blocks
            end = -(-(state.local_tokens + external) // self.block_size)  # the last block may be partial
            state.pending_load = (first, end - first)
        if state.accounted or state.warmup:
            return None  # a preempted request admitted again (its prompt was counted), or a warm-up
        state.accounted = True
        local = min(state.local_tokens, prompt_tokens)
        loaded = min(external, prompt_tokens - local)
        return {"engine_cache": local, "symphony": loaded, "computed": prompt_tokens - local - loaded}

    def step(
        self,
        new: Sequence[tuple[str, Sequence[int]]],
        cached: Sequence[tuple[str, Sequence[int] | None, bool]],
        computed_after: Mapping[str, int],
        tokens_of: Mapping[str, Sequence[int]],
    ) -> StepPlan:
        """The loads and saves of one scheduled step.

        new: (request id, all block ids) of newly scheduled requests; cached: (request id, new block
        ids or None, resumed) of the others, where a resumed request's ids replace its list;
        computed_after: tokens each scheduled request has computed once this step runs;
        tokens_of: each scheduled request's token ids so far."""
        plan = StepPlan()
        for request_id, block_ids in new:
            if request_id in self.requests:
                self.requests[request_id].block_ids = list(block_ids)
        for request_id, added, resumed in cached:
            state = self.requests.get(request_id)
            if state is not None and added is not None:
                state.block_ids = list(added) if resumed else [*state.block_ids, *added]
        for state in self.requests.values():
            if state.pending_load is not None:
                first, count = state.pending_load
                state.pending_load = None
                assert state.held_keys is not None and first + count <= len(state.held_keys)
                tail = state.held_tail if first + count == len(state.held_keys) else 0
                full = count - (1 if tail else 0)
                if full:
                    plan.loads.append(
                        LoadSpec(
                            state.tenant,
                            state.session,
                            first,
                            tuple(state.block_ids[first : first + full]),
                            state.held_keys[first + full - 1],
                        )
                    )
                if tail:  # a load of its own: the worker copies it before the forward (`WorkerSide`)
                    plan.loads.append(
                        LoadSpec(
                            state.tenant,
                            state.session,
                            first + full,
                            (state.block_ids[first + full],),
                            state.held_keys[first + full],
                            tail,
                        )
                    )
                state.saved_blocks = max(state.saved_blocks, first + full)
        for request_id, computed in computed_after.items():
            state = self.requests.get(request_id)
            if state is None or state.warmup or not state.tiers:
                continue
            tokens = tokens_of.get(request_id, ())
            full = min(computed, len(tokens), len(state.block_ids) * self.block_size) // self.block_size
            if full > state.saved_blocks:
                first = state.saved_blocks
                plan.saves.append(
                    SaveSpec(
                        state.tenant,
                        state.session,
                        first,
                        tuple(state.block_ids[first:full]),
                        tuple(tokens[: full * self.block_size]),
                    )
                )
                state.saved_blocks = full
        plan.tail_saves, self._tail_saves = self._tail_saves, []
        return plan

    def finished(
        self, request_id: str, computed_tokens: int = 0, token_ids: Sequence[int] = (), block_ids: Sequence[int] = ()
    ) -> bool:
        """Forget the request. True if its partial last block is to be saved in the next step (the
        caller keeps its blocks until the worker reports it): `computed_tokens` of `token_ids` have
        KV in vLLM blocks `block_ids`, every full block of them saved already, and the rest is
        worth a page."""
        state = self.requests.pop(request_id, None)
        if state is None or state.warmup or not state.tiers:
            return False
        full, tail = divmod(min(computed_tokens, len(token_ids)), self.block_size)
        if not tail or state.saved_blocks < full or full >= len(block_ids):
            return False
        if state.held_tail and state.held_full_blocks == full and state.held_tail >= tail:
            return False  # the tiers hold this tail already: the turn added nothing to that block
        self._tail_saves.append(
            TailSave(
                request_id,
                SaveSpec(
                    state.tenant,
                    state.session,
                    full,
                    (block_ids[full],),
                    tuple(token_ids[: full * self.block_size + tail]),
                ),
            )
        )
        return True
