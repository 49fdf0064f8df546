"""The binary parsers a peer or a disk feeds, fuzzed with hypothesis: the node-local KV channel's
frames (`ipc_wire.recv`), the page stream's requests and session frames, and SSD segment headers.
Whatever the bytes, each answers with a value or its own protocol error: never another exception,
never a hang (every read here ends at the bytes given, the writer having closed)."""

from __future__ import annotations

import socket
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from node_manager.kv import ipc_wire, page_stream
from node_manager.kv.pages import PageMac
from node_manager.kv.segments import SegmentEntry, SegmentFormatError, encode_header, parse_header
from symphony.kv_addressing import BlockKey
from symphony.rpc import kv_pb2
from tests.helpers import TEST_MODEL

KEY_ID = PageMac(b"fuzz").key_id


def _fed(data: bytes) -> socket.socket:
    """The reading end of a connection whose writer sent `data` and closed."""
    reader, writer = socket.socketpair()
    writer.sendall(data)
    writer.close()
    reader.settimeout(5)
    return reader


def _frame_like(body: bytes, payload: bytes, body_len: int | None, payload_len: int | None) -> bytes:
    header = ipc_wire.HEADER.pack(
        len(body) if body_len is None else body_len, len(payload) if payload_len is None else payload_len
    )
    return header + body + payload


json_ish = st.one_of(
    st.binary(max_size=512),
    st.recursive(st.text(max_size=8), lambda inner: st.lists(inner, max_size=3), max_leaves=8).map(
        lambda v: repr(v).encode()
    ),
    st.integers(1, 3000).map(lambda depth: b"[" * depth + b"]" * depth),  # nesting past the recursion limit
    st.integers(4000, 6000).map(lambda digits: b"1" * digits),  # an int past Python's 4300 digits
    st.just(b'{"op": "hello"}'),
    st.just(b'{"op": 7}'),
)


@settings(max_examples=300, deadline=None)
@given(
    body=json_ish,
    payload=st.binary(max_size=64),
    body_len=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    payload_len=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    cut=st.integers(0, 16),
)
def test_kv_channel_frames_parse_or_are_protocol_errors(
    body: bytes, payload: bytes, body_len: int | None, payload_len: int | None, cut: int
) -> None:
    data = _frame_like(body, payload, body_len, payload_len)
    data = data[: max(0, len(data) - cut)]  # a frame cut short too
    with _fed(data) as sock:
        try:
            frame = ipc_wire.recv(sock)
        except ipc_wire.ProtocolError:
            return
    if frame is not None:
        message, _ = frame
        assert isinstance(message, dict) and isinstance(message["op"], str)


@settings(max_examples=300, deadline=None)
@given(
    magic=st.sampled_from([page_stream.MAGIC, b"SKV0", b"\x00\x00\x00\x00"]),
    length=st.integers(0, 2**32 - 1),
    body=st.one_of(
        st.binary(max_size=256),
        st.just(kv_pb2.FetchPagesRequest(session=kv_pb2.SessionRef(tenant="t", session_id="s")).SerializeToString()),
    ),
)
def test_page_stream_requests_parse_or_are_refused(magic: bytes, length: int, body: bytes) -> None:
    with _fed(struct.pack("<4sI", magic, length) + body) as sock:
        try:
            request = page_stream._read_request(sock)
        except (page_stream.ProtocolError, ConnectionError):
            return
    assert isinstance(request, kv_pb2.FetchPagesRequest)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.one_of(st.sampled_from([page_stream.END, page_stream.SESSION]), st.integers(0, 255)),
    extra=st.integers(0, 2**32 - 1),
    rest=st.binary(max_size=256),
)
def test_page_stream_session_frames_parse_or_are_refused(kind: int, extra: int, rest: bytes) -> None:
    header = struct.pack("<BxxxIIII", kind, 0, 0, 0, extra)
    with _fed(header + rest) as sock:
        try:
            status, error = page_stream._read_session(sock)
        except (page_stream.ProtocolError, ConnectionError):
            return
    if status is None:
        assert isinstance(error, str) and error  # the sender's reason, or what was missing
    else:
        assert isinstance(status, kv_pb2.SessionStatus) and error == ""


def _header(count: int) -> bytes:
    entries = [SegmentEntry(BlockKey(bytes([i]) * 32), i % 3, i * 7919) for i in range(count)]
    return encode_header(5, 64, TEST_MODEL, entries, KEY_ID)


@settings(max_examples=400, deadline=None)
@given(
    count=st.integers(0, 4),
    flips=st.lists(st.tuples(st.integers(0, 4095), st.integers(1, 255)), max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 4096)),
)
def test_damaged_segment_headers_are_format_errors(count: int, flips: list[tuple[int, int]], cut: int | None) -> None:
    data = bytearray(_header(count))
    for offset, mask in flips:
        data[offset % len(data)] ^= mask
    if cut is not None:
        del data[cut:]
    try:
        header = parse_header(bytes(data))
    except SegmentFormatError:
        return
    assert len(header.entries) == count and header.key_id == KEY_ID  # what survived is what was written


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=600))
def test_random_bytes_are_never_a_segment(data: bytes) -> None:
    try:
        parse_header(data)
    except SegmentFormatError:
        return
    raise AssertionError("random bytes parsed as a segment header")
