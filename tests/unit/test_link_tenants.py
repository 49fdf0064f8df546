"""symphony.link_tenants and its two readers on wire bytes made by the protocols' own libraries (h11
for HTTP/1.1; hyperframe, hpack and protobuf for gRPC): every byte owned by the right label,
however the relay's reads cut the stream, and anything unreadable called UNATTRIBUTED."""

from __future__ import annotations

from collections.abc import Iterable

import h11
import hpack
import pytest
from hyperframe.frame import ContinuationFrame, DataFrame, HeadersFrame, SettingsFrame, WindowUpdateFrame
from hypothesis import given, settings
from hypothesis import strategies as st

from symphony.link_sniff import Sniff
from symphony.link_tenants import (
    MAX_LABELS,
    MAX_PENDING_BYTES,
    NONE,
    OTHER,
    PENDING,
    UNATTRIBUTED,
    UNKNOWN_KEY,
    ConnectionTally,
    Credit,
    TenantTally,
    http_tenant_of,
    residency_crossings,
)
from symphony.rpc import kv_pb2
from symphony.tenancy import DEFAULT_TENANT, TenantKeys

KEYS = TenantKeys(["acme:key-acme", "globex:key-globex"])
Chunk = tuple[str, bytes]  # (direction, bytes), in the order the relay reads them


def _run(chunks: Iterable[Chunk], cuts: list[int] | None = None) -> TenantTally:
    """Feed `chunks` through a Sniff, each cut at the offsets `cuts` draws (mod its length)."""
    tally = TenantTally(("forward", "reverse"))
    connection = ConnectionTally(Sniff(http_tenant_of(KEYS)), tally)
    draws = iter(cuts or [])
    for direction, data in chunks:
        at = 0
        while at < len(data):
            step = 1 + (next(draws, len(data) - 1) % len(data))
            connection.feed(direction, data[at : at + step])
            at += step
    connection.feed("forward", b"")
    connection.feed("reverse", b"")
    connection.close()
    return tally


def _labels(tally: TenantTally) -> dict[str, dict[str, int]]:
    return {d: tally.snapshot(d) for d in ("forward", "reverse")}


# HTTP/1.1, as aiohttp would send it (one request at a time on a kept-alive connection).


def _http_exchange(key: str | None, method: bytes, body: bytes, answer: bytes, chunked: bool) -> list[Chunk]:
    client, server = h11.Connection(h11.CLIENT), h11.Connection(h11.SERVER)
    headers = [("host", "eu-west"), ("content-length", str(len(body)))]
    if key:
        headers.append(("authorization", f"Bearer {key}"))
    request = client.send(h11.Request(method=method, target="/v1/chat/completions", headers=headers))
    request += client.send(h11.Data(data=body)) + client.send(h11.EndOfMessage())  # type: ignore[operator]
    server.receive_data(request)
    while server.next_event() is not h11.NEED_DATA:
        pass
    framing = [("transfer-encoding", "chunked")] if chunked else [("content-length", str(len(answer)))]
    response = server.send(h11.Response(status_code=200, headers=framing)) or b""
    if method != b"HEAD":
        response += server.send(h11.Data(data=answer)) or b""
    response += server.send(h11.EndOfMessage()) or b""
    return [("forward", request), ("reverse", response)]


HTTP_PLAN = [
    ("key-acme", b"POST", b"x" * 3000, b"y" * 5000, False),
    (None, b"GET", b"", b"z" * 700, True),
    ("key-globex", b"HEAD", b"", b"w" * 900, False),
    ("key-wrong", b"POST", b"q" * 40, b"r" * 60, True),
    ("key-acme", b"GET", b"", b"", False),
]


def _http_expected() -> tuple[list[Chunk], dict[str, dict[str, int]]]:
    chunks: list[Chunk] = []
    expected: dict[str, dict[str, int]] = {"forward": {}, "reverse": {}}
    owners = {"key-acme": "acme", "key-globex": "globex", "key-wrong": UNKNOWN_KEY, None: NONE}
    for key, method, body, answer, chunked in HTTP_PLAN:
        exchange = _http_exchange(key, method, body, answer, chunked)
        chunks += exchange
        for direction, data in exchange:
            counts = expected[direction]
            counts[owners[key]] = counts.get(owners[key], 0) + len(data)
    return chunks, expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=400))
def test_http_bytes_are_their_requests_keys_whatever_the_segments(cuts: list[int]) -> None:
    chunks, expected = _http_expected()
    tally = _run(chunks, cuts)
    assert _labels(tally) == expected
    assert tally.sniff_errors == 0


def test_without_api_keys_every_http_request_is_the_default_tenants() -> None:
    tally = TenantTally(("forward", "reverse"))
    connection = ConnectionTally(Sniff(http_tenant_of(TenantKeys([]))), tally)
    for direction, data in _http_exchange(None, b"GET", b"", b"a" * 10, False):
        connection.feed(direction, data)
    assert set(tally.labels["forward"]) == set(tally.labels["reverse"]) == {DEFAULT_TENANT}


def test_pipelined_requests_of_two_tenants_in_one_read_are_unattributed() -> None:
    first = _http_exchange("key-acme", b"GET", b"", b"a", False)
    second = _http_exchange("key-globex", b"GET", b"", b"b", False)
    tally = _run([("forward", first[0][1] + second[0][1]), first[1], second[1]])
    assert tally.snapshot("forward") == {UNATTRIBUTED: len(first[0][1]) + len(second[0][1])}


def test_an_answer_nobody_asked_for_is_unattributed() -> None:
    tally = _run([("reverse", b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"), ("forward", b"GET / HTTP/1.1\r\n")])
    assert tally.snapshot("reverse") == {UNATTRIBUTED: 38}


# gRPC over h2c, as grpc's channel sends it: frames built with hyperframe, headers with hpack.

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FETCH = "/symphony.v1.KVStore/FetchPages"


class _Grpc:
    """Builds a connection's frames in order, and what each label should own."""

    def __init__(self) -> None:
        self.encoder = hpack.Encoder()
        self.chunks: list[Chunk] = [("forward", PREFACE)]
        self.expected: dict[str, dict[str, int]] = {"forward": {NONE: len(PREFACE)}, "reverse": {}}

    def frame(self, direction: str, frame: object, owner: str) -> None:
        data = frame.serialize()  # type: ignore[attr-defined]
        self.chunks.append((direction, data))
        counts = self.expected[direction]
        counts[owner] = counts.get(owner, 0) + len(data)

    def call(self, stream: int, path: str, message: bytes, owner: str, split_headers: bool = False) -> None:
        block = self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path), ("te", "trailers")])
        if split_headers:
            self.frame("forward", HeadersFrame(stream, block[:5]), owner)
            self.frame("forward", ContinuationFrame(stream, block[5:], flags=["END_HEADERS"]), owner)
        else:
            self.frame("forward", HeadersFrame(stream, block, flags=["END_HEADERS"]), owner)
        # The server opens its window before the message is whole: held, then the stream's.
        self.frame("reverse", WindowUpdateFrame(stream, window_increment=1000), owner)
        wire = b"\x00" + len(message).to_bytes(4, "big") + message
        self.frame("forward", DataFrame(stream, wire[:3]), owner)
        self.frame("forward", DataFrame(stream, wire[3:], flags=["END_STREAM"]), owner)

    def answer(self, stream: int, size: int, owner: str) -> None:
        self.frame("reverse", HeadersFrame(stream, b"\x88", flags=["END_HEADERS"]), owner)
        self.frame("reverse", DataFrame(stream, bytes(size)), owner)
        trailers = HeadersFrame(stream, b"\x40\x0bgrpc-status\x010", flags=["END_HEADERS", "END_STREAM"])
        self.frame("reverse", trailers, owner)


def _fetch(tenant: str) -> bytes:
    ref = kv_pb2.SessionRef(tenant=tenant, session_id="s")
    return kv_pb2.FetchPagesRequest(session=ref, num_blocks=3).SerializeToString()


def _grpc_connection() -> _Grpc:
    wire = _Grpc()
    wire.frame("forward", SettingsFrame(0, settings={SettingsFrame.HEADER_TABLE_SIZE: 8192}), NONE)
    wire.frame("reverse", SettingsFrame(0), NONE)
    wire.call(1, FETCH, _fetch("acme"), "acme")
    wire.call(3, "/symphony.v1.KVStore/GetStoreInfo", b"", NONE)
    wire.call(5, FETCH, _fetch("globex"), "globex", split_headers=True)
    wire.answer(5, 20_000, "globex")
    wire.answer(1, 7_000, "acme")
    wire.frame("reverse", WindowUpdateFrame(0, window_increment=5), NONE)
    wire.call(7, FETCH, _fetch("acme"), "acme")  # the HPACK table now holds :path: a reference
    wire.answer(7, 100, "acme")
    return wire


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=30_000), max_size=400))
def test_grpc_streams_are_their_sessions_tenants_whatever_the_segments(cuts: list[int]) -> None:
    wire = _grpc_connection()
    tally = _run(wire.chunks, cuts)
    assert _labels(tally) == wire.expected
    assert tally.sniff_errors == 0


@pytest.mark.parametrize(
    ("path", "message", "why"),
    [
        (FETCH, _fetch("no tenant"), "a name no tenant can have"),
        ("/symphony.v1.Nowhere/Fetch", _fetch("acme"), "a method of no known service"),
        (FETCH, b"\xff\xff\xff", "a message protobuf cannot read"),
    ],
)
def test_an_rpc_whose_tenant_cannot_be_read_is_unattributed(path: str, message: bytes, why: str) -> None:
    wire = _Grpc()
    wire.call(1, path, message, UNATTRIBUTED)
    wire.answer(1, 50, UNATTRIBUTED)
    assert _labels(_run(wire.chunks)) == wire.expected, why


def test_a_compressed_request_is_unattributed() -> None:
    wire = _Grpc()
    block = wire.encoder.encode([(":path", FETCH)])
    wire.frame("forward", HeadersFrame(1, block, flags=["END_HEADERS"]), UNATTRIBUTED)
    message = _fetch("acme")
    wire.frame("forward", DataFrame(1, b"\x01" + len(message).to_bytes(4, "big") + message), UNATTRIBUTED)
    assert _labels(_run(wire.chunks)) == wire.expected


def test_a_frame_of_a_stream_the_client_never_opened_is_unattributed() -> None:
    wire = _Grpc()
    wire.frame("reverse", DataFrame(9, b"stray"), UNATTRIBUTED)
    assert _labels(_run(wire.chunks)) == wire.expected


# The tally and its bounds.


def test_bytes_of_no_known_protocol_are_unattributed() -> None:
    assert _labels(_run([("forward", b"\x16\x03\x01\x02\x00"), ("reverse", b"\x16\x03")])) == {
        "forward": {UNATTRIBUTED: 5},
        "reverse": {UNATTRIBUTED: 2},
    }


def test_a_head_that_never_completes_is_pending_then_unattributed_at_the_end() -> None:
    tally = TenantTally(("forward", "reverse"))
    connection = ConnectionTally(Sniff(http_tenant_of(KEYS)), tally)
    head = b"POST /v1/completions HTTP/1.1\r\nauthorization: Bea"
    connection.feed("forward", head)
    assert tally.snapshot("forward") == {PENDING: len(head)}
    connection.close()
    assert tally.snapshot("forward") == {UNATTRIBUTED: len(head)}


class _Breaks:
    def feed(self, direction: str, data: bytes) -> list[Credit]:
        if data.startswith(b"boom"):
            raise ValueError("unreadable")
        return []

    def close(self) -> list[Credit]:
        return []


def test_a_reader_that_fails_or_holds_too_much_is_given_up_and_counted() -> None:
    tally = TenantTally(("forward", "reverse"))
    connection = ConnectionTally(_Breaks(), tally)
    connection.feed("forward", b"held")
    connection.feed("reverse", b"boom!")
    connection.feed("forward", b"after")
    assert _labels(tally) == {"forward": {UNATTRIBUTED: 9}, "reverse": {UNATTRIBUTED: 5}}
    assert tally.sniff_errors == 1
    hoarder = ConnectionTally(_Breaks(), tally)
    hoarder.feed("forward", bytes(MAX_PENDING_BYTES + 1))
    assert tally.sniff_errors == 2 and tally.pending == {"forward": 0, "reverse": 0}


def test_labels_past_the_bound_are_counted_as_other() -> None:
    tally = TenantTally(("forward",))
    for i in range(MAX_LABELS + 5):
        tally.credit("forward", f"t{i}", 1)
    assert len(tally.labels["forward"]) == MAX_LABELS + 1 and tally.labels["forward"][OTHER] == 5


def test_residency_crossings_count_a_tenants_bytes_on_links_outside_its_regions() -> None:
    links = [
        {"pair": "eu-west~us-east", "tenant_bytes": {"us-east>eu-west": {"atl": 10}, "eu-west>us-east": {"atl": 5}}},
        {"pair": "ap-south~us-east", "tenant_bytes": {"us-east>ap-south": {"atl": 3, "default": 9}}},
        {"pair": "ap-south~eu-west", "tenant_bytes": {}, "tenant_kv_bytes": {"atl": 4}},
    ]
    rules = {"atl": frozenset({"us-east", "eu-west"}), "eu": frozenset({"eu-west"})}
    assert residency_crossings(links, rules) == {"atl": 3, "eu": 0}
    assert residency_crossings(links, rules, "tenant_kv_bytes") == {"atl": 4, "eu": 0}


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([PREFACE, b"POST /v1/chat/completions HTTP/1.1\r\n", b""]),
    st.lists(st.tuples(st.sampled_from(["forward", "reverse"]), st.binary(min_size=1, max_size=300)), max_size=12),
)
def test_any_bytes_after_any_start_are_all_counted_once_and_never_raise(start: bytes, chunks: list[Chunk]) -> None:
    tally = _run([("forward", start), *chunks] if start else chunks)
    for direction in ("forward", "reverse"):
        fed = sum(len(data) for d, data in [("forward", start), *chunks] if d == direction)
        assert sum(tally.snapshot(direction).values()) == fed
        assert PENDING not in tally.snapshot(direction)
