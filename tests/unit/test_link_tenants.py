"""symphony.link_tenants and its two readers on wire bytes made by the protocols' own libraries (h11
for HTTP/1.1; hyperframe, hpack and protobuf for gRPC): every byte owned by the right label,
however the relay's reads cut the stream, and anything unreadable called UNATTRIBUTED."""

from __future__ import annotations

from collections.abc import Iterable

import h11
import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
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


def _merged(chunks: Iterable[Chunk]) -> list[Chunk]:
    """Consecutive chunks of one direction as one: a read may hold several frames or messages."""
    out: list[Chunk] = []
    for direction, data in chunks:
        if out and out[-1][0] == direction:
            out[-1] = (direction, out[-1][1] + data)
        else:
            out.append((direction, data))
    return out


def _run(chunks: Iterable[Chunk], cuts: list[int] | None = None) -> TenantTally:
    """Feed `chunks` through a Sniff, consecutive ones of a direction joined, then cut at the
    offsets `cuts` draws (mod the length)."""
    tally = TenantTally(("forward", "reverse"))
    connection = ConnectionTally(Sniff(http_tenant_of(KEYS)), tally)
    draws = iter(cuts or [])
    for direction, data in _merged(chunks):
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


def test_an_answer_before_any_request_gives_the_connection_up() -> None:
    tally = _run([("reverse", b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"), ("forward", b"GET / HTTP/1.1\r\n")])
    assert tally.snapshot("reverse") == {UNATTRIBUTED: 38}
    assert tally.sniff_errors == 1


def _feed_all(chunks: Iterable[Chunk]) -> TenantTally:
    tally = TenantTally(("forward", "reverse"))
    connection = ConnectionTally(Sniff(http_tenant_of(KEYS)), tally)
    for direction, data in chunks:
        connection.feed(direction, data)
    return tally


def test_a_request_answered_before_its_body_ended_leaves_the_next_one_readable() -> None:
    """The scheduler answers 401 or 413 without reading the body; the connection is kept alive."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-acme\r\ncontent-length: 10\r\n\r\n"
    refusal = b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 2\r\n\r\n{}"
    follow = _http_exchange("key-globex", b"GET", b"", b"ok", False)
    tally = _feed_all([("forward", head), ("reverse", refusal), ("forward", b"0123456789"), *follow])
    assert _labels(tally) == {
        "forward": {"acme": len(head) + 10, "globex": len(follow[0][1])},
        "reverse": {"acme": len(refusal), "globex": len(follow[1][1])},
    }
    assert tally.sniff_errors == 0


def test_a_request_sent_as_the_server_closed_is_still_its_owners() -> None:
    first = _http_exchange("key-acme", b"GET", b"", b"a", False)
    late = _http_exchange("key-globex", b"GET", b"", b"b", False)[0]
    tally = _feed_all([*first, ("reverse", b""), late])
    assert tally.snapshot("forward") == {"acme": len(first[0][1]), "globex": len(late[1])}
    assert tally.sniff_errors == 0


def test_a_keyless_request_with_a_body_is_unattributed_and_one_without_is_none() -> None:
    with_body = _http_exchange(None, b"POST", b"secret prompt", b"401", False)
    bare = _http_exchange(None, b"GET", b"", b"{}", False)
    tally = _feed_all([*with_body, *bare])
    assert tally.snapshot("forward") == {UNATTRIBUTED: len(with_body[0][1]), NONE: len(bare[0][1])}


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\ndata: one\n\ndata: two\n\n",  # ends at close
    ],
    ids=["100-continue", "204", "close-delimited"],
)
def test_answers_of_every_framing_are_their_requests(answer: bytes) -> None:
    request = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-acme\r\n\r\n"
    tally = _feed_all([("forward", request), ("reverse", answer), ("reverse", b""), ("forward", b"")])
    assert _labels(tally) == {"forward": {"acme": len(request)}, "reverse": {"acme": len(answer)}}
    assert tally.sniff_errors == 0


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
        data = frame if isinstance(frame, bytes) else frame.serialize()  # type: ignore[attr-defined]
        self.chunks.append((direction, data))
        counts = self.expected[direction]
        counts[owner] = counts.get(owner, 0) + len(data)

    def open(self, stream: int, path: str, owner: str, split: bool = False, binary: bool = False) -> None:
        """A call's headers (in a HEADERS and a CONTINUATION when `split`; with raw binary
        metadata, as grpc allows for "-bin" keys, when `binary`)."""
        headers: list[tuple[str, str | bytes]] = [(":method", "POST"), (":path", path), ("te", "trailers")]
        if binary:
            headers.append(("trace-bin", b"\xff\x00\xfe"))
        block = self.encoder.encode(headers)
        if split:
            self.frame("forward", HeadersFrame(stream, block[:5], flags=["PRIORITY"]), owner)
            self.frame("forward", ContinuationFrame(stream, block[5:], flags=["END_HEADERS"]), owner)
        else:
            self.frame("forward", HeadersFrame(stream, block, flags=["END_HEADERS"]), owner)

    def send(self, stream: int, message: bytes, owner: str) -> None:
        """The request message, in two DATA frames (the first padded), the second ending the stream."""
        wire = b"\x00" + len(message).to_bytes(4, "big") + message
        first = DataFrame(stream, wire[:3], flags=["PADDED"])
        first.pad_length = 7
        self.frame("forward", first, owner)
        self.frame("forward", DataFrame(stream, wire[3:], flags=["END_STREAM"]), owner)

    def call(self, stream: int, path: str, message: bytes, owner: str, split: bool = False) -> None:
        self.open(stream, path, owner, split)
        # The server opens its window before the message is whole: held, then the stream's.
        self.frame("reverse", WindowUpdateFrame(stream, window_increment=1000), owner)
        self.send(stream, message, owner)

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
    wire.call(5, FETCH, _fetch("globex"), "globex", split=True)
    wire.answer(5, 20_000, "globex")
    wire.answer(1, 7_000, "acme")
    wire.frame("reverse", WindowUpdateFrame(0, window_increment=5), NONE)
    wire.frame("forward", PingFrame(0, opaque_data=b"12345678"), NONE)
    # A frame of a type HTTP/2 does not define (hyperframe serializes none with a body).
    wire.frame("reverse", b"\x00\x00\x07\xf0\x00\x00\x00\x00\x00unknown", NONE)
    wire.frame("reverse", WindowUpdateFrame(1, window_increment=9), "acme")  # after stream 1 ended
    wire.encoder.header_table_size = 1024  # the next block opens with a table size update
    wire.call(7, FETCH, _fetch("acme"), "acme")
    # Two calls interleaved, one with binary metadata; one answered, the other reset.
    wire.open(9, FETCH, "globex", binary=True)
    wire.open(11, FETCH, "acme")
    wire.frame("reverse", WindowUpdateFrame(11, window_increment=4), "acme")
    wire.send(11, _fetch("acme"), "acme")
    wire.send(9, _fetch("globex"), "globex")
    wire.answer(7, 100, "acme")
    wire.frame("reverse", RstStreamFrame(9, error_code=8), "globex")
    wire.answer(11, 300, "acme")
    wire.frame("forward", GoAwayFrame(0, last_stream_id=11), NONE)
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


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            "/symphony.v1.KVStore/WritePages",
            kv_pb2.PageBatch(session=kv_pb2.SessionRef(tenant="acme")).SerializeToString(),
        ),
        ("/symphony.v1.KVStore/GetPrefetch", kv_pb2.PrefetchRef(prefetch_id="7").SerializeToString()),
        ("//symphony.v1.KVStore/FetchPages", _fetch("acme")),
    ],
    ids=["client-streaming", "names-no-session", "malformed-path"],
)
def test_an_rpc_whose_owner_its_first_message_cannot_tell_is_unattributed(path: str, message: bytes) -> None:
    wire = _Grpc()
    wire.call(1, path, message, UNATTRIBUTED)
    assert _labels(_run(wire.chunks)) == wire.expected


def test_a_tenant_named_like_a_label_is_unattributed() -> None:
    wire = _Grpc()
    wire.call(1, FETCH, _fetch(PENDING), UNATTRIBUTED)
    wire.call(3, FETCH, _fetch(NONE), UNATTRIBUTED)
    assert _labels(_run(wire.chunks)) == wire.expected
    assert http_tenant_of(TenantKeys(["none:k"]))("Bearer k") == UNATTRIBUTED


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


def test_tenants_past_the_bound_are_counted_as_other_and_the_reserved_labels_kept() -> None:
    tally = TenantTally(("forward",))
    for i in range(MAX_LABELS + 5):
        tally.credit("forward", f"t{i}", 1)
    tally.credit("forward", UNATTRIBUTED, 2)
    tally.credit("forward", NONE, 3)
    assert len(tally.labels["forward"]) == MAX_LABELS + 3 and tally.labels["forward"][OTHER] == 5
    assert tally.labels["forward"][UNATTRIBUTED] == 2 and tally.labels["forward"][NONE] == 3


def test_residency_crossings_count_a_tenants_bytes_on_links_outside_its_regions() -> None:
    links = [
        {"pair": "eu-west~us-east", "tenant_bytes": {"us-east>eu-west": {"atl": 10}, "eu-west>us-east": {"atl": 5}}},
        {"pair": "ap-south~us-east", "tenant_bytes": {"us-east>ap-south": {"atl": 3, "default": 9}}},
        {"pair": "ap-south~eu-west", "tenant_bytes": {}, "tenant_kv_bytes": {"atl": 4}},
    ]
    rules = {"atl": frozenset({"us-east", "eu-west"}), "eu": frozenset({"eu-west"})}
    assert residency_crossings(links, rules) == {"atl": 3, "eu": 0}
    assert residency_crossings(links, rules, "tenant_kv_bytes") == {"atl": 4, "eu": 0}
    # Bytes that could not be placed may be anyone's: on a forbidden link they count.
    links[1]["tenant_bytes"]["ap-south>us-east"] = {UNATTRIBUTED: 2, OTHER: 1, NONE: 50}
    assert residency_crossings(links, rules) == {"atl": 6, "eu": 3}


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([PREFACE, b"POST /v1/chat/completions HTTP/1.1\r\n", b""]),
    st.lists(st.tuples(st.sampled_from(["forward", "reverse"]), st.binary(min_size=1, max_size=300)), max_size=12),
)
def test_any_bytes_after_any_start_are_all_counted_once(start: bytes, chunks: list[Chunk]) -> None:
    tally = _run([("forward", start), *chunks] if start else chunks)
    for direction in ("forward", "reverse"):
        fed = sum(len(data) for d, data in [("forward", start), *chunks] if d == direction)
        assert sum(tally.snapshot(direction).values()) == fed
        assert PENDING not in tally.snapshot(direction)


def test_the_clusters_own_tokens_name_no_tenant() -> None:
    """A region's summaries, read with the internal token, and admin calls cross links too: they
    are the cluster's control traffic (NONE), not an unknown key."""
    tenant_of = http_tenant_of(TenantKeys(["acme:k-acme"]), ["internal-123", "admin-456", ""])
    assert tenant_of("Bearer internal-123") == NONE
    assert tenant_of("Bearer admin-456") == NONE
    assert tenant_of("Bearer k-acme") == "acme"
    assert tenant_of("Bearer internal-12") == UNKNOWN_KEY  # nothing near a token counts
    assert tenant_of("Bearer ") == NONE  # no token: no tenant
