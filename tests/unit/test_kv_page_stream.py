"""node_manager.kv.page_stream: the raw TCP page stream between node managers, over real sockets and
real stores (the two node-process version is in tests/integration/test_kv_nodes.py)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from node_manager.kv import page_stream
from node_manager.kv.errors import InvalidRequest
from node_manager.kv.ingest import PageReservation
from node_manager.kv.page_stream import PageStreamServer, fetch_pages
from node_manager.kv.store import TieredStore
from symphony.rpc import kv_pb2
from tests.helpers import TEST_MODEL, wait_until
from tests.unit.kv_store_support import GEOMETRY, LAYERS, TIMEOUT, MakeStore, save_session, tokens

BLOCKS = 6


@pytest.fixture
def server(make_store: MakeStore) -> Iterator[PageStreamServer]:
    stream = PageStreamServer(make_store(), "127.0.0.1", 0, timeout_s=TIMEOUT)
    yield stream
    stream.close()


def _request(session: str, first_block: int = 0, num_blocks: int = 0) -> kv_pb2.FetchPagesRequest:
    return kv_pb2.FetchPagesRequest(
        session=kv_pb2.SessionRef(tenant="acme", session_id=session),
        first_block=first_block,
        num_blocks=num_blocks,
        model_fingerprint=TEST_MODEL,
    )


def _receiver(make_store: MakeStore, session: str, seed: int) -> TieredStore:
    store = make_store()
    store.sessions.put("acme", session, tokens(BLOCKS, seed * 10_000))
    return store


def _dram_pages(store: TieredStore, session: str) -> list[torch.Tensor]:
    slots = store.dram_slots("acme", session)
    return [store.dram.pages[layer_slots] for layer_slots in slots]


@pytest.mark.parametrize("install_batch_bytes", [1, page_stream.INSTALL_BATCH_BYTES])
def test_a_session_in_dram_arrives_whole_and_verified(
    server: PageStreamServer, make_store: MakeStore, monkeypatch: pytest.MonkeyPatch, install_batch_bytes: int
) -> None:
    # 1 byte: every frame is installed on its own, mid-stream; the default: all at the END frame.
    monkeypatch.setattr(page_stream, "INSTALL_BATCH_BYTES", install_batch_bytes)
    data = save_session(server._store, "s", BLOCKS, seed=1)
    receiver = _receiver(make_store, "s", seed=1)
    outcome = fetch_pages(receiver, "127.0.0.1", server.port, _request("s"), TIMEOUT)
    assert (outcome.received, outcome.stored, outcome.error) == (BLOCKS * LAYERS, BLOCKS * LAYERS, "")
    assert all(torch.equal(got, want) for got, want in zip(_dram_pages(receiver, "s"), data, strict=True))
    wait_until(lambda: server._store.pinned_pages() == 0, TIMEOUT, "the sender's pins to go")


def test_pages_only_on_ssd_are_loaded_then_sent(make_store: MakeStore, ssd_dir: Path) -> None:
    writer = make_store()
    data = save_session(writer, "s", BLOCKS, seed=2)
    writer.close(flush_timeout=TIMEOUT)
    sender = make_store(directory=ssd_dir)  # a restarted node: its index rebuilt, nothing in DRAM
    sender.sessions.put("acme", "s", tokens(BLOCKS, 20_000))
    assert all(slot == -1 for layer in sender.dram_slots("acme", "s") for slot in layer)
    stream = PageStreamServer(sender, "127.0.0.1", 0, timeout_s=TIMEOUT)
    try:
        receiver = _receiver(make_store, "s", seed=2)
        outcome = fetch_pages(receiver, "127.0.0.1", stream.port, _request("s", 2, 3), TIMEOUT)
    finally:
        stream.close()
    assert (outcome.received, outcome.stored, outcome.error) == (3 * LAYERS, 3 * LAYERS, "")
    slots = receiver.dram_slots("acme", "s")
    for layer in range(LAYERS):
        assert slots[layer][:2] == [-1, -1] and -1 not in slots[layer][2:5]
        assert torch.equal(receiver.dram.pages[slots[layer][2:5]], data[layer][2:5])


def test_unknown_session_and_bad_ranges_end_the_stream_with_a_reason(
    server: PageStreamServer, make_store: MakeStore
) -> None:
    receiver = _receiver(make_store, "s", seed=3)
    missing = fetch_pages(receiver, "127.0.0.1", server.port, _request("s"), TIMEOUT)
    assert missing.stored == 0 and "no session" in missing.error.lower()
    save_session(server._store, "s", BLOCKS, seed=3)
    beyond = fetch_pages(receiver, "127.0.0.1", server.port, _request("s", first_block=BLOCKS + 1), TIMEOUT)
    assert beyond.stored == 0 and "beyond" in beyond.error


def test_garbage_request_gets_an_end_frame_and_the_server_keeps_serving(
    server: PageStreamServer, make_store: MakeStore
) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        reply = sock.recv(4096)
    kind, *_rest, length = struct.unpack_from("<BxxxIIII", reply)
    assert kind == page_stream.END and b"not a Symphony page stream" in reply[20 : 20 + length]
    save_session(server._store, "s", BLOCKS, seed=4)
    outcome = fetch_pages(_receiver(make_store, "s", seed=4), "127.0.0.1", server.port, _request("s"), TIMEOUT)
    assert outcome.stored == BLOCKS * LAYERS and not outcome.error


def test_a_request_with_session_gets_the_status_first_and_then_the_planned_range(
    server: PageStreamServer, make_store: MakeStore
) -> None:
    data = save_session(server._store, "s", BLOCKS, seed=9)
    receiver = make_store()
    seen: list[kv_pb2.SessionStatus] = []

    def plan(status: kv_pb2.SessionStatus) -> kv_pb2.FetchPagesRequest:
        seen.append(status)
        receiver.sessions.put("acme", "s", list(status.token_ids))
        return _request("s", first_block=1, num_blocks=2)

    opening = kv_pb2.FetchPagesRequest(session=_request("s").session, with_session=True, model_fingerprint=TEST_MODEL)
    outcome = fetch_pages(receiver, "127.0.0.1", server.port, opening, TIMEOUT, plan=plan)
    assert (outcome.received, outcome.stored, outcome.error) == (2 * LAYERS, 2 * LAYERS, "")
    assert outcome.status is not None and seen == [outcome.status]
    assert list(outcome.status.token_ids) == server._store.sessions.get("acme", "s").token_ids.tolist()
    assert outcome.status.loadable_prefix_blocks == BLOCKS
    slots = receiver.dram_slots("acme", "s")
    for layer in range(LAYERS):
        assert slots[layer][0] == -1 and slots[layer][3:] == [-1] * (BLOCKS - 3)
        assert torch.equal(receiver.dram.pages[slots[layer][1:3]], data[layer][1:3])


def test_a_receiver_that_needs_no_pages_hangs_up_and_the_server_goes_on(
    server: PageStreamServer, make_store: MakeStore
) -> None:
    save_session(server._store, "s", BLOCKS, seed=10)
    opening = kv_pb2.FetchPagesRequest(session=_request("s").session, with_session=True, model_fingerprint=TEST_MODEL)
    quiet = fetch_pages(make_store(), "127.0.0.1", server.port, opening, TIMEOUT, plan=lambda status: None)
    assert quiet.status is not None and (quiet.received, quiet.error) == (0, "")
    missing = fetch_pages(
        make_store(),
        "127.0.0.1",
        server.port,
        kv_pb2.FetchPagesRequest(session=_request("gone").session, with_session=True, model_fingerprint=TEST_MODEL),
        TIMEOUT,
        plan=lambda status: None,
    )
    assert missing.status is None and "no session" in missing.error.lower()
    outcome = fetch_pages(_receiver(make_store, "s", seed=10), "127.0.0.1", server.port, _request("s"), TIMEOUT)
    assert outcome.stored == BLOCKS * LAYERS and not outcome.error
    wait_until(lambda: server._slots._value == 8, TIMEOUT, "every stream's slot to come back")


def test_a_range_for_another_session_than_described_is_refused(server: PageStreamServer, make_store: MakeStore) -> None:
    save_session(server._store, "s", BLOCKS, seed=11)
    save_session(server._store, "t", BLOCKS, seed=12)
    opening = kv_pb2.FetchPagesRequest(session=_request("s").session, with_session=True, model_fingerprint=TEST_MODEL)
    receiver = _receiver(make_store, "t", seed=12)
    outcome = fetch_pages(receiver, "127.0.0.1", server.port, opening, TIMEOUT, plan=lambda status: _request("t"))
    assert outcome.stored == 0 and "the range request must name the session just described" in outcome.error
    with pytest.raises(ValueError, match="needs a plan"):
        fetch_pages(receiver, "127.0.0.1", server.port, opening, TIMEOUT)


class _FakeSender:
    """Fault injection: a listener that answers any request with `frames` (raw bytes), then closes."""

    def __init__(self, frames: bytes) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, args=(frames,), daemon=True)
        self.thread.start()

    def _serve(self, frames: bytes) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(frames)
        self.listener.close()


def _frame(layer: int, first_block: int, pages: torch.Tensor, checksums: list[int], page_bytes: int) -> bytes:
    header = struct.pack("<BxxxIIII", page_stream.PAGES, layer, first_block, len(checksums), page_bytes)
    return header + struct.pack(f"<{len(checksums)}Q", *checksums) + pages.numpy().tobytes()


def test_a_flipped_byte_and_a_cut_stream_keep_only_verified_pages(
    server: PageStreamServer, make_store: MakeStore
) -> None:
    data = save_session(server._store, "s", BLOCKS, seed=5)
    checksums = server._store.page_checksums("acme", "s", 0, BLOCKS)
    corrupt = data[0].clone()
    corrupt[1, 3] ^= 1
    frames = (
        _frame(0, 0, corrupt, checksums[:, 0].tolist(), GEOMETRY.page_bytes)
        + _frame(1, 0, data[1], checksums[:, 1].tolist(), GEOMETRY.page_bytes)[:-10]
    )  # cut mid-page
    sender = _FakeSender(frames)
    receiver = _receiver(make_store, "s", seed=5)
    outcome = fetch_pages(receiver, "127.0.0.1", sender.port, _request("s"), TIMEOUT)
    assert "broke" in outcome.error
    assert (outcome.received, outcome.stored) == (BLOCKS, BLOCKS - 1)
    slots = receiver.dram_slots("acme", "s")
    assert slots[0][1] == -1 and all(slots[layer] == [-1] * BLOCKS for layer in range(1, LAYERS))
    kept = [b for b in range(BLOCKS) if b != 1]
    assert torch.equal(receiver.dram.pages[[slots[0][b] for b in kept]], data[0][kept])
    assert receiver.stats()["dram_pages"] == BLOCKS - 1  # the cut frame's slots went back
    sender.thread.join(TIMEOUT)


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack("<BxxxIIII", page_stream.PAGES, 0, 0, 1, GEOMETRY.page_bytes * 2),  # pages of another size
        struct.pack("<BxxxIIII", page_stream.PAGES, 0, 0, 1, GEOMETRY.page_bytes),  # block 0, but 2.. was asked for
        struct.pack("<BxxxIIII", 7, 0, 2, 1, GEOMETRY.page_bytes),  # no such frame kind
    ],
)
def test_frames_that_break_the_protocol_are_refused(make_store: MakeStore, frame: bytes) -> None:
    sender = _FakeSender(frame)
    outcome = fetch_pages(_receiver(make_store, "s", seed=6), "127.0.0.1", sender.port, _request("s", 2), TIMEOUT)
    assert outcome.stored == 0 and "bad frame" in outcome.error
    sender.thread.join(TIMEOUT)


def test_a_malformed_request_body_gets_a_reason(server: PageStreamServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(page_stream.MAGIC + struct.pack("<I", 3) + b"\xff\xff\xff")
        reply = sock.recv(4096)
    kind, *_rest, length = struct.unpack_from("<BxxxIIII", reply)
    assert kind == page_stream.END and b"malformed request" in reply[20 : 20 + length]


def test_streams_beyond_the_bound_are_told_busy(make_store: MakeStore) -> None:
    store = make_store()
    stream = PageStreamServer(store, "127.0.0.1", 0, timeout_s=TIMEOUT, max_streams=1)
    try:
        holder = socket.create_connection(("127.0.0.1", stream.port), timeout=TIMEOUT)  # sends no request
        wait_until(lambda: stream._slots._value == 0, TIMEOUT, "the first stream to take the only slot")
        outcome = fetch_pages(_receiver(make_store, "s", seed=7), "127.0.0.1", stream.port, _request("s"), TIMEOUT)
        assert "busy" in outcome.error
        holder.close()
    finally:
        stream.close()


def test_no_listener_raises_so_the_caller_can_fall_back(make_store: MakeStore) -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    with pytest.raises(OSError):
        fetch_pages(_receiver(make_store, "s", seed=8), "127.0.0.1", port, _request("s"), TIMEOUT)


def test_reserved_pages_are_invisible_until_committed(make_store: MakeStore) -> None:
    store = make_store()
    data = save_session(make_store(), "s", 2, seed=9)
    store.sessions.put("acme", "s", tokens(2, 90_000))
    reservation = store.ingest.reserve_pages("acme", "s", 0, 0, 2)
    assert reservation is not None and store.dram_slots("acme", "s")[0] == [-1, -1]
    for view in store.ingest.reserved_views(reservation):
        view[:] = memoryview(data[0].numpy()).cast("B")[: len(view)]
    with pytest.raises(InvalidRequest):
        store.ingest.commit_pages(reservation, [1])  # one checksum for two pages
    with pytest.raises(InvalidRequest):
        store.ingest.verify_reserved(reservation, None, actual=[1])  # one computed checksum for two pages
    assert store.ingest.commit_pages(reservation, None) == 2
    assert torch.equal(store.dram.pages[store.dram_slots("acme", "s")[0]], data[0])


def _fill(store: TieredStore, layer: int, pages: torch.Tensor, first_block: int = 0) -> PageReservation:
    reservation = store.ingest.reserve_pages("acme", "s", layer, first_block, pages.shape[0])
    assert reservation is not None
    offset = 0
    raw = memoryview(pages.numpy()).cast("B")
    for view in store.ingest.reserved_views(reservation):
        view[:] = raw[offset : offset + len(view)]
        offset += len(view)
    return reservation


def test_committing_layers_together_equals_committing_them_one_by_one(make_store: MakeStore, tmp_path: Path) -> None:
    reference = make_store(directory=tmp_path / "reference")  # the checksums a sender would send
    data = save_session(reference, "s", BLOCKS, seed=11)
    want = reference.page_checksums("acme", "s", 0, BLOCKS)
    together, one_by_one = make_store(directory=tmp_path / "together"), make_store(directory=tmp_path / "one")
    for store in (together, one_by_one):
        store.sessions.put("acme", "s", tokens(BLOCKS, 110_000))
        store.ingest.save_layer("acme", "s", 2, 0, data[2][:2]).result(TIMEOUT)  # layer 2 already holds blocks 0-1
    bad = want[:, 1].tolist()
    bad[3] ^= 1  # one page of layer 1 fails its check
    expected = [want[:, 0].tolist(), bad, want[:, 2].tolist(), want[:, 3].tolist()]
    batch = [(_fill(together, layer, data[layer]), expected[layer]) for layer in range(LAYERS)]
    assert together.ingest.commit_many(batch) == BLOCKS * LAYERS - 1
    assert (
        sum(
            one_by_one.ingest.commit_pages(_fill(one_by_one, layer, data[layer]), expected[layer])
            for layer in range(LAYERS)
        )
        == BLOCKS * LAYERS - 1
    )
    for store in (together, one_by_one):
        slots = store.dram_slots("acme", "s")
        assert slots[1][3] == -1 and sum(slot == -1 for layer in slots for slot in layer) == 1
        for layer in range(LAYERS):
            kept = [b for b in range(BLOCKS) if slots[layer][b] >= 0]
            assert torch.equal(store.dram.pages[[slots[layer][b] for b in kept]], data[layer][kept])
        assert store.stats()["dram_pages"] == BLOCKS * LAYERS - 1  # the duplicates' and bad page's slots went back
        assert store.loadable_prefix_blocks("acme", "s") == 3  # block 3 lacks layer 1
        assert store.write_behind.flush(TIMEOUT) and store.pinned_pages() == 0
    assert together.residency("acme", "s") == one_by_one.residency("acme", "s")


def test_released_reservations_give_their_slots_back(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=0, dram_pages=4)
    store.sessions.put("acme", "s", tokens(2))
    first = store.ingest.reserve_pages("acme", "s", 0, 0, 2)
    assert first is not None and store.ingest.reserve_pages("acme", "s", 1, 0, 2) is not None
    assert store.ingest.reserve_pages("acme", "s", 2, 0, 2) is None  # full of reservations, nothing evictable
    store.ingest.release_pages(first)
    assert store.ingest.reserve_pages("acme", "s", 2, 0, 2) is not None


def test_pinned_dram_pages_hold_only_when_dram_has_them_all(make_store: MakeStore) -> None:
    store = make_store()
    save_session(store, "s", BLOCKS, seed=10, layers=[0, 1])
    with store.pinned_dram_pages("acme", "s", 0, BLOCKS) as held:
        assert held is None  # layers 2 and 3 were never saved
    save_session(store, "s", BLOCKS, seed=10, layers=[2, 3])
    assert store.write_behind.flush(TIMEOUT)
    with store.pinned_dram_pages("acme", "s", 0, BLOCKS) as held:
        assert held is not None
        slots, checksums = held
        assert slots.shape == checksums.shape == (BLOCKS, LAYERS)
        assert store.pinned_pages() == BLOCKS * LAYERS
    assert store.pinned_pages() == 0
