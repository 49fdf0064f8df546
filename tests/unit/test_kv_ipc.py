"""The node-local KV channel (node_manager.kv.ipc_server + node_manager.connector.kv_client) over a
real Unix socket, against a real store whose DRAM arena the test maps as the vLLM worker would."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from node_manager.connector import lookup as lookup_module
from node_manager.connector.kv_client import KVChannelError, NodeKVClient
from node_manager.connector.lookup import HistoryLookup
from node_manager.kv.errors import SessionNotFound
from node_manager.kv.ipc_server import LocalKVServer
from node_manager.kv.loader import RowTarget
from node_manager.kv.pages import Tier
from node_manager.kv.slots import DramArena
from node_manager.kv.store import TieredStore
from symphony.kv_addressing import tail_key
from tests.helpers import TEST_MODEL, wait_until
from tests.unit.kv_store_support import (
    BLOCK,
    GEOMETRY,
    LAYERS,
    TIMEOUT,
    WORDS,
    MakeStore,
    page_data,
    save_session,
    tokens,
)

BLOCKS = 5


@pytest.fixture
def store(make_store: MakeStore) -> TieredStore:
    return make_store(hbm_pages=0, dram_pages=64)


@pytest.fixture
def server(store: TieredStore, tmp_path: Path) -> Iterator[LocalKVServer]:
    served = LocalKVServer(store, tmp_path / "kv.sock")
    yield served
    served.close()


@pytest.fixture
def client(server: LocalKVServer) -> Iterator[NodeKVClient]:
    c = NodeKVClient(server.path, timeout_s=TIMEOUT)
    yield c
    c.close()


@pytest.fixture
def lookup(client: NodeKVClient) -> Iterator[HistoryLookup]:
    history = HistoryLookup(client, TEST_MODEL)
    yield history
    history.close()


def _handled(client: NodeKVClient) -> None:
    """Return once the server handled everything sent on this connection before (requests on one
    connection are answered in order; a registration gets no answer of its own)."""
    client.hello()


def _arena(client: NodeKVClient) -> DramArena:
    hello = client.hello()
    assert (hello["num_layers"], hello["page_bytes"], hello["block_size"]) == (LAYERS, GEOMETRY.page_bytes, BLOCK)
    return DramArena.attach(hello["arena"], GEOMETRY, hello["arena_bytes"])


def _sample(store: TieredStore, name: str, **labels: str) -> float:
    return store.metrics.registry.get_sample_value(name, labels) or 0.0


def _read_load(client: NodeKVClient, items: list[dict]) -> tuple[int, list[tuple[int, np.ndarray]]]:
    load_id, layers = client.load(items, timeout_s=TIMEOUT)
    return load_id, list(layers)


def _sent(lookup: HistoryLookup, client: NodeKVClient) -> None:
    """Send the lookup's queued registrations (as the connector does once per scheduler step) and
    return once the server has handled them."""
    lookup.send_registrations()
    _handled(client)


def test_match_registers_tokens_and_counts_held_blocks(
    store: TieredStore, client: NodeKVClient, lookup: HistoryLookup
) -> None:
    assert lookup.match("acme", "fresh", tokens(3)).blocks == 0
    assert lookup.match("acme", "fresh2", tokens(2)).blocks == 0
    _handled(client)
    with pytest.raises(SessionNotFound):  # queued, not sent: the match waited on no one
        store.sessions.get("acme", "fresh")
    _sent(lookup, client)  # both in one write
    assert store.sessions.get("acme", "fresh").blocks.num_blocks == 3
    assert store.sessions.get("acme", "fresh2").blocks.num_blocks == 2
    save_session(store, "s", BLOCKS, seed=1)
    history = tokens(BLOCKS, base=10_000)
    # The next turn: the stored history plus a new message; only the stored blocks are loadable.
    held = lookup.match("acme", "s", [*history, *range(7, 7 + 2 * BLOCK + 1)])
    assert held.blocks == BLOCKS == store.loadable_prefix_blocks("acme", "s")
    assert held.keys == store.sessions.get("acme", "s").blocks.block_keys[:BLOCKS]
    # Same tokens under another tenant: keys are namespaced, nothing is shared.
    assert lookup.match("other", "s", history).blocks == 0
    # A long held history, partly on SSD, is found whole.
    save_session(store, "long", 40, seed=2, flush_each=True)  # on SSD: more than DRAM holds
    held = lookup.match("acme", "long", [*tokens(40, base=20_000), *range(3, 3 + 5 * BLOCK)])
    assert held.keys == store.sessions.get("acme", "long").blocks.block_keys[:40]


def test_match_hashes_only_what_the_tiers_could_load(
    store: TieredStore, lookup: HistoryLookup, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_session(store, "s", 3, seed=9)
    history = tokens(3, base=90_000)
    hashed: list[bytes] = []
    real = lookup_module.keys_after

    def counting(*args: Any) -> Iterator[bytes]:
        for key in real(*args):
            hashed.append(key)
            yield key

    monkeypatch.setattr(lookup_module, "keys_after", counting)
    prompt = [*history, *range(5, 5 + 20 * BLOCK + 1)]  # 3 held blocks, then 20 new full blocks
    assert lookup.match("acme", "s", prompt).blocks == 3
    assert len(hashed) == 4  # the held blocks and the first one the tiers lack; none of the later ones
    hashed.clear()
    assert lookup.match("acme", "s", [*prompt, *range(BLOCK)]).blocks == 3  # the session's next turn
    assert len(hashed) == 1  # the held keys are kept from the last turn: only the first new block
    hashed.clear()
    assert lookup.match("acme", "s", [7, *prompt[1:]]).blocks == 0  # an edited history: nothing kept
    assert len(hashed) == 1


def test_match_follows_evictions_and_a_restarted_node_manager(make_store: MakeStore, tmp_path: Path) -> None:
    store = make_store(hbm_pages=0)
    save_session(store, "s", BLOCKS, seed=11)
    assert store.write_behind.flush(TIMEOUT)
    path = tmp_path / "restart.sock"
    server = LocalKVServer(store, path)
    client = NodeKVClient(path, timeout_s=TIMEOUT)
    lookup = HistoryLookup(client, TEST_MODEL)
    history = tokens(BLOCKS, base=110_000)
    try:
        assert lookup.match("acme", "s", history).blocks == BLOCKS
        with store.lock:  # block 2 loses its only copy of layer 1 (its SSD copy; DRAM's went first)
            key = store.sessions.get("acme", "s").blocks.block_keys[2]
            for tier in Tier:
                store.drop_copy(key, 1, tier, "capacity")
        assert lookup.match("acme", "s", history).blocks == 2
        server.close()
        store.close()
        # A new node manager on the same socket path, serving what is on disk (a new index file).
        store = make_store(hbm_pages=0)
        server = LocalKVServer(store, path)
        with pytest.raises(OSError):
            lookup.match("acme", "s", history)  # the old connection is gone: the connector recomputes
        held = lookup.match("acme", "s", history)  # reconnected: the new index is mapped
        _sent(lookup, client)
        assert held.blocks == store.loadable_prefix_blocks("acme", "s") > 0
    finally:
        lookup.close()
        client.close()
        server.close()


def test_a_node_manager_gone_between_match_and_send_makes_the_next_match_ask_again(
    make_store: MakeStore, tmp_path: Path
) -> None:
    store = make_store(hbm_pages=0)
    save_session(store, "s", BLOCKS, seed=12)
    path = tmp_path / "gone.sock"
    server = LocalKVServer(store, path)
    client = NodeKVClient(path, timeout_s=TIMEOUT)
    lookup = HistoryLookup(client, TEST_MODEL)
    history = tokens(BLOCKS, base=120_000)
    try:
        assert lookup.match("acme", "s", history).blocks == BLOCKS
        server.close()  # down, and nothing takes its place: its index file stays mapped here
        wait_until(lambda: _send_fails(lookup, history), TIMEOUT, "a send to the closed server to fail")
        with pytest.raises(OSError):
            lookup.match("acme", "s", history)  # not answered from the dead node manager's index
    finally:
        lookup.close()
        client.close()


def _send_fails(lookup: HistoryLookup, history: list[int]) -> bool:
    """A match and the send of its registration: False while the kernel still takes the bytes of
    a connection whose other end closed (the first write after a close can succeed)."""
    lookup.match("acme", "s", history)
    try:
        lookup.send_registrations()
    except OSError:
        return True
    return False


def test_load_from_dram_pins_until_release(store: TieredStore, client: NodeKVClient) -> None:
    data = save_session(store, "s", BLOCKS, seed=2)
    assert store.write_behind.flush(TIMEOUT)
    arena = _arena(client)
    try:
        load_id, layers = _read_load(client, [{"tenant": "acme", "session": "s", "first_block": 1, "count": 3}])
        assert [layer for layer, _ in layers] == list(range(LAYERS))
        for layer, slots in layers:
            assert (slots >= 0).all()
            assert torch.equal(arena.pages[torch.from_numpy(slots.copy())], data[layer][1:4])
        assert store.pinned_pages() == 3 * LAYERS, "the worker's pages must stay put until it releases them"
        client.release(load_id)
        wait_until(lambda: store.pinned_pages() == 0, TIMEOUT, "pins released")
        assert _sample(store, "symphony_connector_tokens_loaded_total", tier="DRAM") == 3 * BLOCK
    finally:
        arena.close()


def test_load_promotes_ssd_pages_and_marks_unknown_items(make_store: MakeStore, ssd_dir: Path, tmp_path: Path) -> None:
    first = make_store(hbm_pages=0)
    data = save_session(first, "s", BLOCKS, seed=3)
    first.close()
    store = make_store(hbm_pages=0)  # same directory: everything is on SSD only
    store.sessions.put("acme", "s", tokens(BLOCKS, base=30_000))
    server = LocalKVServer(store, tmp_path / "kv2.sock")
    client = NodeKVClient(server.path, timeout_s=TIMEOUT)
    arena = _arena(client)
    try:
        items = [
            {"tenant": "acme", "session": "s", "first_block": 0, "count": BLOCKS},
            {"tenant": "acme", "session": "nobody", "first_block": 0, "count": 2},
        ]
        load_id, layers = _read_load(client, items)
        for layer, slots in layers:
            assert len(slots) == BLOCKS + 2
            assert (slots[BLOCKS:] == -1).all(), "an unknown session is recomputed, not an error"
            assert torch.equal(arena.pages[torch.from_numpy(slots[:BLOCKS].copy())], data[layer])
        client.release(load_id)
        wait_until(lambda: store.pinned_pages() == 0, TIMEOUT, "pins released")
        # Counted once, by the promoting load: SSD hits, no DRAM hits or misses for the same pages.
        registry = store.metrics.registry
        assert registry.get_sample_value("symphony_kv_load_hits_total", {"tier": "SSD"}) == BLOCKS * LAYERS
        assert (registry.get_sample_value("symphony_kv_load_hits_total", {"tier": "DRAM"}) or 0) == 0
        assert (registry.get_sample_value("symphony_kv_load_misses_total") or 0) == 0
        assert _sample(store, "symphony_connector_tokens_loaded_total", tier="SSD") == BLOCKS * BLOCK
        assert _sample(store, "symphony_connector_tokens_loaded_total", tier="DRAM") == 0
    finally:
        arena.close()
        client.close()
        server.close()


def test_a_load_waits_for_its_registration_and_never_serves_another_history(
    store: TieredStore, server: LocalKVServer, client: NodeKVClient, lookup: HistoryLookup
) -> None:
    data = save_session(store, "s", BLOCKS, seed=8)
    assert store.write_behind.flush(TIMEOUT)
    history = tokens(BLOCKS, base=80_000)
    key = store.sessions.get("acme", "s").blocks.block_keys[-1].hex()
    store.sessions.put("acme", "s", tokens(BLOCKS, base=5))  # meanwhile: another history, same session id
    item = {"tenant": "acme", "session": "s", "first_block": 0, "count": BLOCKS, "key": key}
    worker = NodeKVClient(server.path, timeout_s=TIMEOUT)  # the worker's own connection
    arena = _arena(client)
    try:
        # The worker's load of the request's history comes before the scheduler side's registration.
        load_id, layers = worker.load([item], timeout_s=TIMEOUT)
        wait_until(lambda: server.loads_awaiting_registration == 1, TIMEOUT, "the load to wait")
        lookup.match("acme", "s", history)
        lookup.send_registrations()
        for layer, slots in layers:
            assert torch.equal(arena.pages[torch.from_numpy(slots.copy())], data[layer])
        worker.release(load_id)
        # Re-registered with the other history and nothing more coming: never its pages, a recompute.
        store.sessions.put("acme", "s", tokens(BLOCKS, base=5))
        server.registration_wait_s = 0.05
        load_id, layers = worker.load([item], timeout_s=TIMEOUT)
        assert all((slots == -1).all() for _, slots in layers)
        worker.release(load_id)
    finally:
        arena.close()
        worker.close()


def test_reserve_fill_commit_saves_pages(store: TieredStore, client: NodeKVClient) -> None:
    history = tokens(BLOCKS, base=40_000)
    data = page_data(2, seed=4)
    arena = _arena_rw(client)
    try:
        reservation, slots = client.reserve("acme", "s", 1, 2, history[: 3 * BLOCK])
        assert slots.shape == (LAYERS, 2) and (slots >= 0).all()
        for layer in range(LAYERS):
            arena.pages[torch.from_numpy(slots[layer].copy())] = data[layer]
        assert client.commit(reservation) == 2 * LAYERS
    finally:
        arena.close()
    dest = [torch.zeros(2, WORDS, dtype=torch.int64) for _ in range(LAYERS)]
    results = store.loads.into_rows("acme", "s", 1, 2, target=RowTarget(dest, [0, 1])).wait_all(TIMEOUT)
    assert all(r.failed == () for r in results)
    assert all(torch.equal(dest[layer], data[layer]) for layer in range(LAYERS))


def test_a_turns_partial_tail_is_saved_found_by_the_next_turn_and_loaded(
    store: TieredStore, server: LocalKVServer, client: NodeKVClient, lookup: HistoryLookup
) -> None:
    history = tokens(2, base=60_000, tail=BLOCK - 1)  # a turn that ended one token short of a block
    data = page_data(3, seed=12)
    arena = _arena_rw(client)
    worker = NodeKVClient(server.path, timeout_s=TIMEOUT)
    try:
        full, full_slots = client.reserve("acme", "s", 0, 2, history[: 2 * BLOCK])
        tail, tail_slots = client.reserve("acme", "s", 2, 1, history)  # past the full blocks: the tail
        for layer in range(LAYERS):
            arena.pages[torch.from_numpy(full_slots[layer].copy())] = data[layer][:2]
            arena.pages[torch.from_numpy(tail_slots[layer].copy())] = data[layer][2:]
        assert client.commit(full) == 2 * LAYERS and client.commit(tail) == LAYERS
        assert _sample(store, "symphony_connector_tail_tokens_saved_total") == BLOCK - 1
        # The next turn continues the history: two full blocks and the tail's tokens are held.
        held = lookup.match("acme", "s", [*history, *range(5, 5 + BLOCK + 2)])
        assert (held.blocks, held.tail_tokens) == (3, BLOCK - 1)
        _sent(lookup, client)
        keys = store.sessions.get("acme", "s").blocks.block_keys  # the new turn's history
        assert held.keys == (*keys[:2], tail_key(keys[1], history[2 * BLOCK :]))
        assert held.keys[-1] != keys[2]  # not the full block the new turn's tokens fill
        item = {
            "tenant": "acme",
            "session": "s",
            "first_block": 0,
            "count": 3,
            "key": held.keys[-1].hex(),
            "tail_tokens": BLOCK - 1,
        }
        load_id, layers = worker.load([item], timeout_s=TIMEOUT)
        for layer, slots in layers:
            assert torch.equal(arena.pages[torch.from_numpy(slots.copy())], data[layer])
        worker.release(load_id)
        assert _sample(store, "symphony_connector_tokens_loaded_total", tier="DRAM") == 3 * BLOCK - 1
        # A turn that changed the tail's last token finds the full blocks only; another tenant nothing.
        changed = [*history[:-1], 7, *range(5, 9)]
        assert lookup.match("other", "s", [*history, 5]).blocks == 0
        held = lookup.match("acme", "s", changed)
        assert (held.blocks, held.tail_tokens) == (2, 0)
        _sent(lookup, client)
        # The tail addressed with a length the history does not have: never served.
        server.registration_wait_s = 0.05
        load_id, layers = worker.load([{**item, "tail_tokens": BLOCK - 2}], timeout_s=TIMEOUT)
        assert all((slots == -1).all() for _, slots in layers)
        worker.release(load_id)
    finally:
        worker.close()
        arena.close()


def _arena_rw(client: NodeKVClient) -> DramArena:
    hello = client.hello()
    return DramArena.attach(hello["arena"], GEOMETRY, hello["arena_bytes"], writable=True)


def test_a_closed_connections_pins_and_reservations_are_held_back_until_close(
    store: TieredStore, server: LocalKVServer
) -> None:
    server.dropped_hold_s = 3600.0
    save_session(store, "s", BLOCKS, seed=5)
    assert store.write_behind.flush(TIMEOUT)
    used_before = store.stats()["dram_pages"]
    client = NodeKVClient(server.path, timeout_s=TIMEOUT)
    _read_load(client, [{"tenant": "acme", "session": "s", "first_block": 0, "count": BLOCKS}])
    client.reserve("acme", "s2", 0, 2, tokens(2, base=50_000))
    assert store.pinned_pages() == BLOCKS * LAYERS and store.stats()["dram_pages"] == used_before + 2 * LAYERS
    client.close()  # a worker killed mid-step
    wait_until(lambda: server.open_connections == 0, TIMEOUT, "the server to see the connection end")
    # Its device copies may still be running: nothing goes back yet.
    assert server.held_back > 0
    assert store.pinned_pages() == BLOCKS * LAYERS and store.stats()["dram_pages"] == used_before + 2 * LAYERS
    server.close()  # the node manager stops: everything goes back now
    assert server.held_back == 0
    assert store.pinned_pages() == 0 and store.stats()["dram_pages"] == used_before


def test_a_closed_connections_pins_go_back_when_the_hold_ends(store: TieredStore, server: LocalKVServer) -> None:
    server.dropped_hold_s = 0.05
    save_session(store, "s", BLOCKS, seed=5)
    assert store.write_behind.flush(TIMEOUT)
    client = NodeKVClient(server.path, timeout_s=TIMEOUT)
    _read_load(client, [{"tenant": "acme", "session": "s", "first_block": 0, "count": BLOCKS}])
    assert store.pinned_pages() == BLOCKS * LAYERS
    client.close()
    wait_until(lambda: store.pinned_pages() == 0 and server.held_back == 0, TIMEOUT, "the held-back pins given back")


def test_bad_requests_get_errors_and_the_server_keeps_serving(server: LocalKVServer, client: NodeKVClient) -> None:
    with pytest.raises(KVChannelError, match="invalid_argument"):
        client._call({"op": "teleport"})
    with pytest.raises(KVChannelError, match="invalid_argument"):
        client._call(
            {
                "op": "load",
                "id": 1,
                "items": [{"tenant": "acme", "session": "s", "first_block": 0, "count": 1, "key": "zz"}],
            }
        )
    with pytest.raises(KVChannelError, match="invalid_argument"):
        client.reserve("acme", "s", 3, 2, tokens(2))  # blocks beyond the tokens given
    with pytest.raises(KVChannelError, match="invalid_argument"):
        client.commit(12345)
    client.release(-3)  # refused without a reply, which would otherwise answer the next call
    client.abort(99999)
    # Garbage on a raw connection: that connection is dropped, the server is not.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(server.path))
        raw.sendall(struct.pack("<II", 5, 0) + b"\xff\xfe{{{")
        raw.settimeout(TIMEOUT)
        assert raw.recv(1) == b""
    client.register("acme", "", tokens(1))  # refused without a reply
    assert client.hello()["num_layers"] == LAYERS


def test_reports_feed_the_connector_metrics(store: TieredStore, client: NodeKVClient) -> None:
    client.report(
        prompt_tokens={"engine_cache": 64, "symphony": 2048, "computed": 40},
        load_error_blocks=2,
        layer_waits_s=[0.0, 0.002, 0.5],
    )
    client.report(prompt_tokens={"computed": 10})
    wait_until(
        lambda: _sample(store, "symphony_connector_prompt_tokens_total", source="computed") == 50,
        TIMEOUT,
        "the reports to be counted",
    )
    assert _sample(store, "symphony_connector_prompt_tokens_total", source="symphony") == 2048
    assert _sample(store, "symphony_connector_prompt_tokens_total", source="engine_cache") == 64
    assert _sample(store, "symphony_connector_load_error_blocks_total") == 2
    assert _sample(store, "symphony_connector_layer_wait_seconds_count") == 3
    assert _sample(store, "symphony_connector_layer_wait_seconds_bucket", le="0.0025") == 2


@pytest.mark.parametrize(
    "report",
    [
        {"prompt_tokens": {"computed": -1}},
        {"prompt_tokens": [1, 2]},
        {"load_error_blocks": "many"},
        {"layer_waits_s": [-0.1]},
        {"layer_waits_s": "slow"},
        {"layer_waits_s": [0.0] * 5000},
    ],
)
def test_bad_reports_are_refused_and_count_nothing(store: TieredStore, client: NodeKVClient, report: dict) -> None:
    client._call({"op": "report", **report}, reply=False)
    # No reply, not even an error: the next call on the connection gets its own answer.
    assert client.hello()["num_layers"] == LAYERS
    assert _sample(store, "symphony_connector_layer_wait_seconds_count") == 0
    assert _sample(store, "symphony_connector_load_error_blocks_total") == 0


class _OnePrefetch:
    """Stands in for the runtime's PrefetchQueue: the channel only asks it for a session's prefetch."""

    def __init__(self, session: tuple[str, str], target: Tier) -> None:
        self.jobs = {session: SimpleNamespace(target=target)}

    def claim_arrival(self, session: tuple[str, str]) -> SimpleNamespace | None:
        return self.jobs.pop(session, None)


def test_a_request_for_a_prefetched_session_counts_whether_its_kv_was_ready(
    store: TieredStore, server: LocalKVServer, client: NodeKVClient, lookup: HistoryLookup
) -> None:
    save_session(store, "ready", 2, seed=5)
    server.prefetches = _OnePrefetch(("acme", "ready"), Tier.DRAM)  # type: ignore[assignment]
    assert lookup.match("acme", "ready", tokens(2, base=50_000, tail=3)).blocks == 2
    assert lookup.match("acme", "ready", tokens(2, base=50_000, tail=3)).blocks == 2  # counted once per prefetch
    _sent(lookup, client)
    assert _sample(store, "symphony_kv_prefetch_arrivals_total", ready="yes") == 1
    save_session(store, "late", 2, seed=6)
    server.prefetches = _OnePrefetch(("acme", "late"), Tier.HBM)  # type: ignore[assignment]
    lookup.match("acme", "late", tokens(2, base=60_000))
    _sent(lookup, client)
    assert _sample(store, "symphony_kv_prefetch_arrivals_total", ready="no") == 1


def test_an_engine_warm_up_is_not_the_prefetched_sessions_arrival(
    store: TieredStore, server: LocalKVServer, client: NodeKVClient, lookup: HistoryLookup
) -> None:
    save_session(store, "warm", 2, seed=7)
    server.prefetches = _OnePrefetch(("acme", "warm"), Tier.HBM)  # type: ignore[assignment]
    assert lookup.match("acme", "warm", tokens(2, base=70_000), warmup=True).blocks == 2
    _sent(lookup, client)
    assert _sample(store, "symphony_kv_prefetch_arrivals_total", ready="no") == 0
    lookup.match("acme", "warm", tokens(2, base=70_000, tail=5))  # the turn itself: counted now
    _sent(lookup, client)
    assert _sample(store, "symphony_kv_prefetch_arrivals_total", ready="no") == 1
