"""node_manager.kv.block_index: the shared-memory index of complete blocks, alone and kept by the store."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from uuid import uuid4

import pytest

from node_manager.kv.block_index import MIN_SLOTS, BlockIndex, BlockIndexReader, fingerprint, slots_for
from node_manager.kv.errors import HistoryChanged
from node_manager.kv.pages import Tier
from node_manager.kv.store import TieredStore
from symphony.kv_addressing import BlockKey, chain_block_keys
from tests.helpers import TEST_MODEL
from tests.unit.kv_store_support import (
    BLOCK,
    LAYERS,
    TIMEOUT,
    MakeStore,
    load_rows,
    reopen_with_a_flipped_page,
    save_session,
    tokens,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _key(home: int, tag: int) -> BlockKey:
    """A key whose fingerprint lands on slot `home` of a MIN_SLOTS table (`tag` tells keys apart)."""
    return BlockKey((home + tag * MIN_SLOTS).to_bytes(8, "little") + bytes(24))


@pytest.fixture
def index() -> BlockIndex:
    built = BlockIndex(f"symphony-test-index-{uuid4().hex[:8]}", max_blocks=100)
    yield built
    built.close()
    assert not built.path.exists(), "close() must remove the index file"


def test_sizes_keep_the_table_at_most_half_full() -> None:
    assert slots_for(1) == MIN_SLOTS
    assert slots_for(MIN_SLOTS) == 2 * MIN_SLOTS
    assert slots_for(100_000) == 1 << 18  # 2 MiB of slots for ~100k blocks (17 GiB of SmolLM2 KV)
    assert fingerprint(BlockKey(bytes(32))) != 0  # 0 is an empty slot


def test_a_reader_sees_adds_and_discards(index: BlockIndex) -> None:
    keys = chain_block_keys(TEST_MODEL, "acme", list(range(40)), 4).block_keys
    reader = BlockIndexReader(index.name)
    try:
        assert reader.leading(keys) == 0
        index.add(keys[:6])
        index.add(keys[:3])  # again: nothing changes
        assert len(index) == 6 and reader.leading(keys) == 6
        index.discard(keys[2])
        index.discard(keys[2])  # gone already: nothing changes
        assert len(index) == 5 and reader.leading(keys) == 2
        assert keys[5] in index and keys[2] not in index
    finally:
        reader.close()


def test_a_reader_tells_when_its_index_was_closed_or_replaced() -> None:
    name = f"symphony-test-index-{uuid4().hex[:8]}"
    first = BlockIndex(name, max_blocks=10)
    reader = BlockIndexReader(name)
    second: BlockIndex | None = None
    try:
        assert not reader.replaced()
        second = BlockIndex(name, max_blocks=10)  # a restarted node manager claims the name (after a kill -9)
        assert reader.replaced()
        fresh = BlockIndexReader(name)
        assert not fresh.replaced()
        second.close()
        assert fresh.replaced()  # closed by its node manager
        fresh.close()
    finally:
        reader.close()
        first._table.close()  # its file is already gone: the second index unlinked it


def test_deleting_inside_a_collision_cluster_keeps_every_other_key_reachable(index: BlockIndex) -> None:
    # Keys homed on the last slots wrap around the table's end into the first ones; deleting any
    # of them must shift the rest back so that none sits behind an empty slot.
    rng = random.Random(5)
    keys = [
        _key(home, tag)
        for tag, home in enumerate([MIN_SLOTS - 2, MIN_SLOTS - 2, MIN_SLOTS - 1, 0, 0, 1, MIN_SLOTS - 2, 2, 1])
    ]
    for _ in range(50):
        index.add(keys)
        present = set(keys)
        for key in rng.sample(keys, len(keys)):
            index.discard(key)
            present.discard(key)
            assert all((k in index) == (k in present) for k in keys)
        assert len(index) == 0


def test_looking_many_keys_up_at_once_agrees_with_one_by_one(index: BlockIndex) -> None:
    # Collision clusters that wrap around the table's end, keys absent behind present ones, and a
    # fingerprint of 0 (stored as 1): the batched probe must answer exactly as `find` does.
    rng = random.Random(7)
    homes = [MIN_SLOTS - 2, MIN_SLOTS - 2, MIN_SLOTS - 1, 0, 0, 1, MIN_SLOTS - 2, 2, 1, 500, 500, 501]
    homes += [rng.randrange(600, 640) for _ in range(40)]  # enough keys for the batched lookup
    keys = [_key(home, tag) for tag, home in enumerate(homes)] + [BlockKey(bytes(32))]
    reader = BlockIndexReader(index.name)
    try:
        for _ in range(30):
            index.add(rng.sample(keys, rng.randint(0, len(keys))))
            order = rng.sample(keys, len(keys))
            one_by_one = next((i for i, key in enumerate(order) if key not in index), len(order))
            assert reader.leading(order) == one_by_one
            assert reader.leading(order[:5]) == min(one_by_one, 5)  # a few keys: looked up one by one
            for key in keys:
                index.discard(key)
        assert reader.leading([]) == 0
    finally:
        reader.close()


def test_holds_and_the_run_at_a_home_slot_agree_with_find(index: BlockIndex) -> None:
    # A cluster that wraps around the table's end, keys whose home is elsewhere inside it, and one
    # deleted from its middle (the entries after it shift back).
    rng = random.Random(11)
    homes = [MIN_SLOTS - 1, MIN_SLOTS - 1, 0, MIN_SLOTS - 1, 1, 0, 300]
    keys = [_key(home, tag) for tag, home in enumerate(homes)]
    reader = BlockIndexReader(index.name)
    try:
        for _ in range(30):
            index.add(rng.sample(keys, rng.randint(0, len(keys))))
            for key in rng.sample(keys, 2):
                index.discard(key)
            for key in keys:
                assert reader.holds(key) == (key in index)
                # Every held key sharing this key's home is in the run read from that home.
                run = reader.run_at_home_of(fingerprint(key))
                assert {
                    fingerprint(k)
                    for k in keys
                    if k in index and fingerprint(k) % MIN_SLOTS == fingerprint(key) % MIN_SLOTS
                } <= set(run)
                assert 0 not in run
            for key in keys:
                index.discard(key)
        assert reader.run_at_home_of(fingerprint(keys[0])) == []
    finally:
        reader.close()


def test_adds_beyond_the_bound_are_refused_not_overfilled(index: BlockIndex) -> None:
    keys = chain_block_keys(TEST_MODEL, "acme", list(range(4 * 150)), 4).block_keys
    index.add(keys)
    assert len(index) == 100 and index.refused == 50
    assert sum(key in index for key in keys) == 100


def test_a_reader_refuses_a_file_that_is_not_an_index(tmp_path: Path) -> None:
    name = f"symphony-test-notindex-{uuid4().hex[:8]}"
    path = Path("/dev/shm") / name
    path.write_bytes(b"\x00" * 4096)
    try:
        with pytest.raises(ValueError, match="not a Symphony block index"):
            BlockIndexReader(name)
    finally:
        path.unlink()
    with pytest.raises(FileNotFoundError):
        BlockIndexReader(name)


def test_another_process_reads_the_same_index(index: BlockIndex) -> None:
    keys = chain_block_keys(TEST_MODEL, "acme", list(range(4 * 8)), 4).block_keys
    index.add(keys[:5])
    script = (
        "import sys; from node_manager.kv.block_index import BlockIndexReader; "
        "from symphony.kv_addressing import chain_block_keys; from tests.helpers import TEST_MODEL; "
        f"r = BlockIndexReader({index.name!r}); "
        "print(r.leading(chain_block_keys(TEST_MODEL, 'acme', list(range(32)), 4).block_keys))"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "5"


# ---- kept by the store: the index holds exactly the blocks loadable_prefix_blocks counts ----------


def _indexed(store: TieredStore, session: str) -> int:
    reader = BlockIndexReader(store.block_index.name)
    try:
        return reader.leading(store.sessions.get("acme", session).blocks.block_keys)
    finally:
        reader.close()


def test_saved_blocks_enter_the_index_once_every_layer_is_in(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=0)
    save_session(store, "s", 3, seed=1, layers=list(range(LAYERS - 1)))
    assert _indexed(store, "s") == 0 == store.loadable_prefix_blocks("acme", "s")
    save_session(store, "s", 3, seed=1, layers=[LAYERS - 1])
    assert _indexed(store, "s") == 3 == store.loadable_prefix_blocks("acme", "s")


def test_a_block_leaves_the_index_with_the_last_copy_of_a_page(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=0)
    save_session(store, "s", 3, seed=2)
    assert store.write_behind.flush(TIMEOUT)
    key = store.sessions.get("acme", "s").blocks.block_keys[1]
    with store.lock:
        store.drop_copy(key, 2, Tier.DRAM, "capacity")  # SSD still has it: still complete
    assert _indexed(store, "s") == 3
    with store.lock:
        store.drop_copy(key, 2, Tier.SSD, "capacity")
    assert _indexed(store, "s") == 1 == store.loadable_prefix_blocks("acme", "s")


def test_a_restarted_store_indexes_what_is_on_disk_and_drops_corrupt_pages(
    make_store: MakeStore, ssd_dir: Path
) -> None:
    second, _ = reopen_with_a_flipped_page(make_store, ssd_dir, "s", 3, seed=3, bad=(2, 1, 5, 0x01))
    assert _indexed(second, "s") == 3  # on disk; the damage is found when the page is read
    _, results = load_rows(second, "s", 3)
    assert results[1].failed == (2,)
    assert _indexed(second, "s") == 2 == second.loadable_prefix_blocks("acme", "s")


def test_an_address_of_another_history_is_refused(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=0)
    save_session(store, "s", 3, seed=4)
    assert store.write_behind.flush(TIMEOUT)
    other = chain_block_keys(TEST_MODEL, "acme", tokens(3, base=99_000), BLOCK).block_keys
    mine = store.sessions.get("acme", "s").blocks.block_keys
    pin = store.pin_dram("acme", "s", 0, 3, range(LAYERS), last_key=mine[2])
    store.unpin_dram(pin)
    for call in (
        lambda: store.pin_dram("acme", "s", 0, 3, range(LAYERS), last_key=other[2]),
        lambda: store.loads.promote("acme", "s", 0, 3, tier=Tier.DRAM, last_key=other[2]),
        lambda: store.ingest.reserve_pages("acme", "s", 0, 1, 2, last_key=other[2]),
    ):
        with pytest.raises(HistoryChanged):
            call()
    assert store.pinned_pages() == 0
