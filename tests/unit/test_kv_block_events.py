"""The store's block events (node_manager.kv.holdings and its hooks): a full block is STORED in a
tier once that tier holds every layer of it, REMOVED once it loses one; tails are never named; a
snapshot equals what the events add up to."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_manager.kv.block_events import TIER_ENGINE, BlockEventKind, EventBatch
from node_manager.kv.block_watch import snapshot
from node_manager.kv.errors import SessionNotFound
from node_manager.kv.pages import Tier
from node_manager.kv.segments import parse_header
from node_manager.kv.store import TieredStore
from node_manager.kv.store_config import StoreConfig
from symphony.kv_addressing import BlockKey
from tests.helpers import TEST_MODEL
from tests.unit.kv_store_support import (
    GEOMETRY,
    LAYERS,
    PAGE,
    TIMEOUT,
    MakeStore,
    hold_ssd_writes,
    load_rows,
    metric,
    page_data,
    reopen_with_a_flipped_page,
    save_session,
    segment_files,
    tokens,
)

STORED, REMOVED, CLEARED = BlockEventKind.STORED, BlockEventKind.REMOVED, BlockEventKind.CLEARED
Named = tuple[BlockEventKind, int, BlockKey]  # one block named by one event


class Watch:
    """The blocks a store's events name, one entry per key, in order, since the last call (how
    events were coalesced into batches does not show)."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        store.events.replay(store.events.seq)  # seals what was published before the watch began
        self.seq = store.events.seq

    def new(self) -> list[Named]:
        batches = self.store.events.replay(self.seq)
        assert batches is not None, "the ring lost batches a test needs"
        if batches:
            self.seq = batches[-1].seq
        return [(e.kind, e.tier, key) for batch in batches for e in batch.events for key in e.keys]


def each(kind: BlockEventKind, tier: int, keys: tuple[BlockKey, ...]) -> list[Named]:
    return [(kind, tier, key) for key in keys]


def fold(batches: list[EventBatch], state: dict[int, set[BlockKey]] | None = None) -> dict[int, set[BlockKey]]:
    """What a receiver knows after applying `batches` in order. Checks that every event is a change:
    STORED names no key held already, REMOVED only keys held."""
    state = {} if state is None else state
    for batch in batches:
        for event in batch.events:
            held = state.setdefault(event.tier, set())
            if event.kind is STORED:
                assert not held.intersection(event.keys), f"STORED again in tier {event.tier}"
                held.update(event.keys)
            elif event.kind is REMOVED:
                assert held.issuperset(event.keys), f"REMOVED what tier {event.tier} did not hold"
                held.difference_update(event.keys)
            else:
                held.clear()
    return state


def keys_of(store: TieredStore, session: str, tenant: str = "acme") -> tuple[BlockKey, ...]:
    return store.sessions.get(tenant, session).blocks.block_keys


def whole_in(store: TieredStore, session: str, tier: Tier) -> set[BlockKey]:
    """The session's blocks `tier` holds in every layer, from the store's residency report."""
    layers = store.residency("acme", session)[tier]
    return {key for block, key in enumerate(keys_of(store, session)) if all(layer[block] for layer in layers)}


def test_a_saved_session_is_stored_in_dram_once_per_full_block_then_on_ssd(
    make_store: MakeStore, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store()
    gate = hold_ssd_writes(store, monkeypatch)
    watch = Watch(store)
    store.sessions.put("acme", "s", tokens(3, base=0, tail=2))
    data = page_data(4, seed=1)
    for layer in range(LAYERS):
        assert store.ingest.save_layer("acme", "s", layer, 0, data[layer][:3]).result(TIMEOUT) == 3
        assert store.ingest.save_layer("acme", "s", layer, 3, data[layer][3:], tail_tokens=2).result(TIMEOUT) == 1
        if layer < LAYERS - 1:
            assert watch.new() == [], f"a block missing layers {layer + 1}.. is held nowhere whole"
    full = keys_of(store, "s")
    assert watch.new() == each(STORED, Tier.DRAM, full), "once per block, the tail never"
    gate.set()
    assert store.write_behind.flush(TIMEOUT)
    assert watch.new() == each(STORED, Tier.SSD, full)
    assert store.loadable_tail_tokens("acme", "s") == 2, "the tail is kept, only not named"

    entries = [entry for path in segment_files(ssd_dir) for entry in parse_header(path.read_bytes()).entries]
    assert {e.block_key for e in entries if not e.tail} == set(full), "pages on SSD say which are tails"
    assert len({e.block_key for e in entries if e.tail}) == 1
    store.close()
    restarted = make_store()
    assert restarted.events.seq == 0, "pages found at start publish nothing: the snapshot has them"
    assert restarted.holdings.snapshot() == {Tier.HBM: [], Tier.DRAM: [], Tier.SSD: list(full)}


def test_dram_eviction_removes_a_block_from_dram_once_and_keeps_it_on_ssd(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=0, dram_pages=2 * LAYERS)
    watch = Watch(store)
    save_session(store, "a", 1, seed=20)
    save_session(store, "b", 1, seed=21)
    assert store.write_behind.flush(TIMEOUT)
    (a,), (b,) = keys_of(store, "a"), keys_of(store, "b")
    stored = [(STORED, Tier.DRAM, a), (STORED, Tier.DRAM, b), (STORED, Tier.SSD, a), (STORED, Tier.SSD, b)]
    assert sorted(watch.new()) == sorted(stored)  # the write-behind may persist a before b is saved
    save_session(store, "c", 1, seed=22)  # evicts a's four pages, one per layer
    events = [e for e in watch.new() if e[1] != Tier.SSD]  # c's SSD copy may or may not be written yet
    assert events == [(REMOVED, Tier.DRAM, a), (STORED, Tier.DRAM, keys_of(store, "c")[0])]
    assert whole_in(store, "a", Tier.SSD) == {a}


def test_demotion_and_promotion_move_blocks_between_tiers(make_store: MakeStore) -> None:
    store = make_store()
    save_session(store, "s", 3, seed=5)
    assert store.write_behind.flush(TIMEOUT)
    full = keys_of(store, "s")
    watch = Watch(store)
    assert store.loads.promote("acme", "s", tier=Tier.HBM).wait_all(TIMEOUT)
    assert watch.new() == each(STORED, Tier.HBM, full), "whole once the last layer is in"
    assert store.demote("acme", "s", Tier.HBM) == 3 * LAYERS
    assert store.demote("acme", "s", Tier.DRAM) == 3 * LAYERS
    assert watch.new() == each(REMOVED, Tier.HBM, full) + each(REMOVED, Tier.DRAM, full)
    assert store.loads.promote("acme", "s", tier=Tier.DRAM).wait_all(TIMEOUT)
    assert watch.new() == each(STORED, Tier.DRAM, full)


def test_hbm_eviction_removes_blocks_from_hbm(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=2 * LAYERS)
    for name, seed in (("a", 1), ("b", 2)):
        save_session(store, name, 2, seed=seed)
    assert store.write_behind.flush(TIMEOUT)  # its SSD events come before the watch
    watch = Watch(store)
    assert store.loads.promote("acme", "a", tier=Tier.HBM).wait_all(TIMEOUT)
    assert store.loads.promote("acme", "b", tier=Tier.HBM).wait_all(TIMEOUT)  # takes a's slots
    events = watch.new()
    a = keys_of(store, "a")
    assert events[:2] == each(STORED, Tier.HBM, a)
    assert all(tier == Tier.HBM for _, tier, _ in events)
    assert sorted(k for kind, _, k in events if kind is REMOVED) == sorted(a), "a yields the top tier to b"
    assert sorted(k for kind, _, k in events[2:] if kind is STORED) == sorted(whole_in(store, "b", Tier.HBM))
    assert whole_in(store, "b", Tier.HBM), "b got some of the top tier"


def test_ssd_segment_eviction_removes_blocks_from_ssd(make_store: MakeStore) -> None:
    # Room for about nine segments of one page (the write-behind often writes a layer as soon as it
    # is saved): two sessions and a bit; older segments are evicted first.
    store = make_store(dram_pages=64, ssd_bytes=9 * (4096 + PAGE))
    watch = Watch(store)
    state: dict[int, set[BlockKey]] = {}
    for n in range(5):
        save_session(store, f"s{n}", 1, seed=30 + n)
        assert store.write_behind.flush(TIMEOUT)
    batches = store.events.replay(watch.seq) or []
    fold(batches, state)
    removed = {k for batch in batches for e in batch.events if e.kind is REMOVED for k in e.keys}
    gone = [n for n in range(5) if whole_in(store, f"s{n}", Tier.SSD) != set(keys_of(store, f"s{n}"))]
    assert gone and len(gone) < 5, "the test needs sessions to lose their SSD copy and others to keep it"
    assert metric(store, "symphony_kv_evictions_total", tier="SSD", reason="capacity") > 0
    assert removed and removed <= {keys_of(store, f"s{n}")[0] for n in gone}, "sessions once whole on SSD left it"
    assert state[Tier.SSD] == {keys_of(store, f"s{n}")[0] for n in range(5) if n not in gone}
    assert state[Tier.DRAM] == {keys_of(store, f"s{n}")[0] for n in range(5)}


def test_a_page_that_fails_its_checksum_on_ssd_removes_its_block_from_ssd(make_store: MakeStore, ssd_dir: Path) -> None:
    store, _ = reopen_with_a_flipped_page(make_store, ssd_dir, "s", 2, seed=9, bad=(1, 2, 5, 0x10))
    watch = Watch(store)
    _, results = load_rows(store, "s", 2)
    assert results[2].failed == (1,)
    assert watch.new() == [(REMOVED, Tier.SSD, keys_of(store, "s")[1])]


def test_a_save_with_other_bytes_supersedes_the_block_everywhere_then_stores_it_again(make_store: MakeStore) -> None:
    store = make_store()
    save_session(store, "s", 1, seed=3, base=0)
    assert store.write_behind.flush(TIMEOUT)
    watch = Watch(store)
    save_session(store, "s", 1, seed=4, base=0)  # same tokens, other bytes
    assert store.write_behind.flush(TIMEOUT)
    (key,) = keys_of(store, "s")
    events = watch.new()
    # Each layer's new copy replaces the old one in DRAM while the other layers keep the block
    # whole there. On SSD likewise, except that the write-behind may persist a new layer before the
    # next one's old copy is superseded (the block whole in between) or after: 1 to LAYERS pairs.
    assert [e for e in events if e[1] == Tier.DRAM] == [(REMOVED, Tier.DRAM, key), (STORED, Tier.DRAM, key)] * LAYERS
    ssd = [e for e in events if e[1] == Tier.SSD]
    assert 1 <= len(ssd) // 2 <= LAYERS and ssd == [(REMOVED, Tier.SSD, key), (STORED, Tier.SSD, key)] * (len(ssd) // 2)


async def test_a_snapshot_names_every_tier_and_the_engine_at_one_seq(make_store: MakeStore) -> None:
    store = make_store()
    save_session(store, "s", 2, seed=8)
    assert store.write_behind.flush(TIMEOUT)
    engine_key = BlockKey(b"\x07" * 32)
    store.events.engine_emitter()("stored", [engine_key])
    batches = snapshot(store)
    seq = store.events.seq
    assert all(b.seq == seq for b in batches) and batches[0].snapshot_begin and batches[-1].snapshot_end
    held = fold(batches)
    full = set(keys_of(store, "s"))
    assert held == {Tier.DRAM: full, Tier.SSD: full, TIER_ENGINE: {engine_key}}


# ---- property: at every point, the events so far add up to a snapshot ---------------------------

SESSIONS = 3
Op = tuple[str, int, int]
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.integers(0, SESSIONS - 1), st.integers(0, 1)),
        st.tuples(st.just("flush"), st.just(0), st.just(0)),
        st.tuples(st.just("demote"), st.integers(0, SESSIONS - 1), st.sampled_from([Tier.HBM, Tier.DRAM])),
        st.tuples(st.just("promote"), st.integers(0, SESSIONS - 1), st.sampled_from([Tier.HBM, Tier.DRAM])),
        st.tuples(st.just("load"), st.integers(0, SESSIONS - 1), st.just(0)),
    ),
    min_size=1,
    max_size=12,
)


@contextlib.contextmanager
def small_store() -> Iterator[TieredStore]:
    """A store small enough that every tier evicts: 2 sessions' worth of HBM, 3 of DRAM, a few segments of SSD."""
    with tempfile.TemporaryDirectory() as directory:
        config = StoreConfig(
            hbm_bytes=4 * LAYERS * PAGE,
            dram_bytes=6 * LAYERS * PAGE,
            ssd_bytes=5 * (4096 + 4 * PAGE),
            ssd_dir=Path(directory),
            arena_name=f"symphony-test-{uuid4().hex[:8]}",
            model=TEST_MODEL,
        )
        store = TieredStore(GEOMETRY, config)
        try:
            yield store
        finally:
            store.close(flush_timeout=TIMEOUT)


def _apply(store: TieredStore, op: Op) -> None:
    name, session, arg = op
    if name == "save":
        store.sessions.put("acme", f"s{session}", tokens(2, base=session * 1000))
        data = page_data(2, seed=10 * session + arg)  # another seed: same keys, other bytes
        for layer in range(LAYERS):
            store.ingest.save_layer("acme", f"s{session}", layer, 0, data[layer]).result(TIMEOUT)
        return
    if name == "flush":
        assert store.write_behind.flush(TIMEOUT)
        return
    if not _known(store, session):  # not saved yet
        return
    if name == "demote":
        store.demote("acme", f"s{session}", Tier(arg))
    elif name == "promote":
        store.loads.promote("acme", f"s{session}", tier=Tier(arg)).wait_all(TIMEOUT)
    else:
        load_rows(store, f"s{session}", 2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_the_events_always_add_up_to_a_snapshot_of_the_store(ops: list[Op]) -> None:
    with small_store() as store:
        state: dict[int, set[BlockKey]] = {}
        seen = 0
        for op in ops:
            _apply(store, op)
            # The write-behind may still be publishing: the snapshot and the events up to its seq agree.
            batches = snapshot(store)
            live = store.events.replay(seen) or []
            fold([b for b in live if b.seq <= batches[0].seq], state)
            seen = batches[0].seq
            expected = {tier: keys for tier, keys in fold(batches).items() if keys}
            assert {tier: keys for tier, keys in state.items() if keys} == expected, op
        assert store.write_behind.flush(TIMEOUT)
        batches = snapshot(store)
        fold(store.events.replay(seen) or [], state)
        for tier in Tier:  # against the store's own report of each session's residency
            named = set().union(*(whole_in(store, f"s{n}", tier) for n in range(SESSIONS) if _known(store, n)))
            assert state.get(tier, set()) == named, tier


def _known(store: TieredStore, session: int) -> bool:
    try:
        store.sessions.get("acme", f"s{session}")
    except SessionNotFound:
        return False
    return True
