"""The tenant of the gRPC bytes on a link connection (`symphony.link_tenants`), read from the HTTP/2
frames with h2's own lower layers (hyperframe for frames, hpack for header blocks) and protobuf.

A node's peer channel multiplexes every tenant's RPCs on one connection, so bytes are owned per
stream: every frame of a stream, in either direction (its headers, messages, trailers, window
updates, resets, and frames that trail its end), is its RPC's. An RPC is its request's
`session.tenant` (`SessionRef`), read from the first request message of the method that `:path`
names (`grpc_tenant_label`). An RPC whose request has no fields (GetStoreInfo, Health, Status)
asks for nothing of a tenant's and is NONE, as are the connection preface and stream 0's frames
(settings, pings, connection window updates). Any other RPC is UNATTRIBUTED: a client-streaming
one (its later messages may name other sessions), one whose request names something other than a
session, an unknown method. A stream's bytes are held until its first message has arrived. The
tenant is the one the request names: what the server sends back on the stream is counted as
that tenant's, whatever it holds.

h2's state machines are not used: they enforce their own side's settings and flow control and
refuse streams they did not open, which a passive reader of both sides cannot satisfy. Only the
client's header blocks are decoded (every one, in order, so the HPACK table stays in step); the
server's frames are only walked by their headers, and no DATA payload is copied but a stream's
first request message.

Bounds: `MAX_STREAMS` open streams (the least recently active forgotten first) and
`MAX_CLOSED_STREAMS` ended ones (the oldest first) remembered, a frame of a forgotten stream
being UNATTRIBUTED; a first message of at most `MAX_MESSAGE_BYTES` (a bigger or compressed one
leaves its stream UNATTRIBUTED); a header block of at most `MAX_HEADER_BLOCK_BYTES` (past it the
HPACK table cannot be kept, so the parser raises and the link stops attributing the connection).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import hpack
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from hyperframe.frame import ContinuationFrame, DataFrame, Frame, HeadersFrame, RstStreamFrame

import symphony.rpc  # noqa: F401 (registers the services' descriptors)
from symphony.link_tenants import NONE, UNATTRIBUTED, Credit, grpc_tenant_label

PREFACE_BYTES = 24
FRAME_HEADER_BYTES = 9
MAX_STREAMS = 1024  # open streams remembered
MAX_CLOSED_STREAMS = 256  # ended streams remembered, for the frames that may trail them
MAX_HEADER_BLOCK_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 64 * 1024
MAX_READ_FRAME_BYTES = MAX_HEADER_BLOCK_BYTES + 256  # a frame whose payload is read (padding aside)
_SESSION_MESSAGE = "symphony.v1.SessionRef"


@dataclass(slots=True)
class _Stream:
    owner: str | None = None  # None: its first request message has not arrived
    held: dict[str, int] = field(default_factory=lambda: {"forward": 0, "reverse": 0})
    message: bytearray | None = None  # the first request message while it arrives, when awaited
    request: Any = None  # that message's class
    ended: set[str] = field(default_factory=set)  # the directions that sent END_STREAM


_UNKNOWN = _Stream(owner=UNATTRIBUTED)  # a stream the client never opened, or one forgotten


@dataclass(slots=True)
class _Reader:
    """One direction's place in its frame stream."""

    header: bytearray = field(default_factory=bytearray)  # the next frame header's bytes so far
    frame: Frame | None = None  # the frame whose payload is arriving
    stream: _Stream | None = None  # its stream (None: stream 0)
    left: int = 0  # its payload bytes still to come
    body: bytearray | None = None  # its payload, when it is read


class GrpcAttributor:
    def __init__(self) -> None:
        self._preface_left = PREFACE_BYTES  # Sniff saw it: the connection starts with it
        self._readers = {"forward": _Reader(), "reverse": _Reader()}
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_BLOCK_BYTES)
        self._decoder.max_allowed_table_size = MAX_HEADER_BLOCK_BYTES
        self._streams: OrderedDict[int, _Stream] = OrderedDict()  # least recently active first
        self._closed: OrderedDict[int, _Stream] = OrderedDict()  # oldest first
        self._block: bytearray | None = None  # a header block continued by CONTINUATION frames
        self._block_stream: _Stream | None = None
        self._credits: list[Credit] = []

    def feed(self, direction: str, data: bytes) -> list[Credit]:
        self._credits = []
        view = memoryview(data)
        if direction == "forward" and self._preface_left:
            n = min(self._preface_left, len(view))
            self._preface_left -= n
            self._credits.append((direction, NONE, n))
            view = view[n:]
        reader = self._readers[direction]
        while view:
            if reader.frame is None:
                need = FRAME_HEADER_BYTES - len(reader.header)
                reader.header += view[:need]
                view = view[need:]
                if len(reader.header) == FRAME_HEADER_BYTES:
                    self._start_frame(direction, reader)
                continue
            n = min(reader.left, len(view))
            if reader.body is not None:
                reader.body += view[:n]
            self._charge(direction, reader.stream, n)
            reader.left -= n
            view = view[n:]
            if not reader.left:
                self._end_frame(direction, reader)
        return self._credits

    def close(self) -> list[Credit]:
        return []  # held bytes (unresolved streams, partial frame headers) the link calls UNATTRIBUTED

    def _start_frame(self, direction: str, reader: _Reader) -> None:
        frame, length = Frame.parse_frame_header(memoryview(bytes(reader.header)))
        reader.header.clear()
        stream = self._stream(direction, frame)
        reader.frame, reader.stream, reader.left = frame, stream, length
        awaited = isinstance(frame, DataFrame) and stream is not None and stream.message is not None
        if direction == "forward" and awaited and stream is not None and length > MAX_READ_FRAME_BYTES:
            self._resolve(stream, UNATTRIBUTED)  # a message too big to read: the stream's unread
            awaited = False
        reads = direction == "forward" and (isinstance(frame, HeadersFrame | ContinuationFrame) or awaited)
        if reads and length > MAX_READ_FRAME_BYTES:  # a header block: the HPACK table cannot skip it
            raise ValueError(f"a {type(frame).__name__} of {length} bytes is more than is read")
        reader.body = bytearray() if reads else None
        self._charge(direction, stream, FRAME_HEADER_BYTES)
        if not length:
            self._end_frame(direction, reader)

    def _stream(self, direction: str, frame: Frame) -> _Stream | None:
        sid = frame.stream_id
        if not sid:
            return None
        stream = self._streams.get(sid)
        if stream is not None:
            self._streams.move_to_end(sid)
            return stream
        if direction != "forward" or not isinstance(frame, HeadersFrame):
            return self._closed.get(sid, _UNKNOWN)
        if len(self._streams) >= MAX_STREAMS:
            _, forgotten = self._streams.popitem(last=False)
            self._resolve(forgotten, UNATTRIBUTED)
        stream = self._streams[sid] = _Stream()
        return stream

    def _charge(self, direction: str, stream: _Stream | None, n: int) -> None:
        if not n:
            return
        if stream is None:
            self._credits.append((direction, NONE, n))
        elif stream.owner is None:
            stream.held[direction] += n
        else:
            self._credits.append((direction, stream.owner, n))

    def _resolve(self, stream: _Stream, owner: str) -> None:
        if stream.owner is not None:
            return
        stream.owner, stream.message, stream.request = owner, None, None
        for direction, n in stream.held.items():
            if n:
                self._credits.append((direction, owner, n))
        stream.held = {}

    def _end_stream(self, direction: str, frame: Frame, stream: _Stream) -> None:
        """Note a direction's END_STREAM (or a reset, both); an ended stream is retired to the
        closed streams, where frames that trail it still find their owner."""
        if isinstance(frame, RstStreamFrame):
            stream.ended.update(("forward", "reverse"))
        elif "END_STREAM" in frame.flags:
            stream.ended.add(direction)
        if len(stream.ended) < 2 or self._streams.get(frame.stream_id) is not stream:
            return
        del self._streams[frame.stream_id]
        if len(self._closed) >= MAX_CLOSED_STREAMS:
            _, forgotten = self._closed.popitem(last=False)
            self._resolve(forgotten, UNATTRIBUTED)
        self._closed[frame.stream_id] = stream

    def _end_frame(self, direction: str, reader: _Reader) -> None:
        frame, stream, body = reader.frame, reader.stream, reader.body
        reader.frame = reader.stream = reader.body = None
        if frame is None:
            return
        if body is not None:
            self._read_frame(frame, stream, body)
        if stream is not None and stream is not _UNKNOWN:
            self._end_stream(direction, frame, stream)

    def _read_frame(self, frame: Frame, stream: _Stream | None, body: bytearray) -> None:
        """A forward frame whose payload is read: a header block's part, or an awaited message's."""
        frame.parse_body(memoryview(body))
        if isinstance(frame, HeadersFrame):
            if self._block is not None:
                raise ValueError("HEADERS inside another stream's header block")
            self._block, self._block_stream = bytearray(frame.data), stream
        elif isinstance(frame, ContinuationFrame):
            if self._block is None or stream is not self._block_stream:
                raise ValueError("CONTINUATION outside a header block")
            self._block += frame.data
        elif isinstance(frame, DataFrame) and stream is not None:
            self._read_message(stream, frame)
            return
        if self._block is not None and len(self._block) > MAX_HEADER_BLOCK_BYTES:
            raise ValueError(f"a header block of more than {MAX_HEADER_BLOCK_BYTES} bytes")
        if "END_HEADERS" in frame.flags:
            block, owner_stream = bytes(self._block or b""), self._block_stream
            self._block = self._block_stream = None
            headers = self._decoder.decode(block, raw=True)  # every block, so the table stays in step
            if owner_stream is not None and owner_stream.owner is None and owner_stream.message is None:
                self._await_message(owner_stream, headers)

    def _await_message(self, stream: _Stream, headers: Any) -> None:
        path = next((bytes(v).decode("latin-1") for k, v in headers if k == b":path"), "")
        request = _request_class(path)
        if request is None:
            self._resolve(stream, UNATTRIBUTED)
        elif request is _NO_SESSION:
            self._resolve(stream, NONE)
        else:
            stream.message, stream.request = bytearray(), request

    def _read_message(self, stream: _Stream, frame: DataFrame) -> None:
        message = stream.message
        if message is None:
            return
        message += frame.data
        if len(message) >= 5:
            compressed, length = message[0], int.from_bytes(message[1:5], "big")
            if compressed or length > MAX_MESSAGE_BYTES:
                self._resolve(stream, UNATTRIBUTED)
                return
            if len(message) >= 5 + length:
                try:
                    tenant = stream.request.FromString(bytes(message[5 : 5 + length])).session.tenant
                except DecodeError:
                    self._resolve(stream, UNATTRIBUTED)
                    return
                self._resolve(stream, grpc_tenant_label(tenant))
                return
        if "END_STREAM" in frame.flags:
            self._resolve(stream, UNATTRIBUTED)  # the request ended without a whole message


_NO_SESSION: Any = object()
_classes: dict[str, Any] = {}  # :path -> request class, or _NO_SESSION (registered methods only)
_PATH = re.compile(r"/([^/]+)/([^/]+)")


def _request_class(path: str) -> Any:
    """The request message class of the RPC at `path` ("/package.Service/Method"); _NO_SESSION
    when its request has no fields at all (it asks for nothing of any tenant's: GetStoreInfo,
    Health, Status); None when its owner cannot be read from it: no registered method, a
    client-streaming one (only the first message would be read), or a request without a
    `session` that still names something (a prefetch id, a block watch)."""
    if path in _classes:
        return _classes[path]
    match = _PATH.fullmatch(path)
    if match is None:
        return None
    try:
        method = descriptor_pool.Default().FindServiceByName(match[1]).methods_by_name[match[2]]
    except KeyError:
        return None
    request = method.input_type
    session = request.fields_by_name.get("session")
    if method.client_streaming:
        found = None
    elif not request.fields:
        found = _NO_SESSION
    elif session is None or session.message_type is None or session.message_type.full_name != _SESSION_MESSAGE:
        found = None
    else:
        found = message_factory.GetMessageClass(request)
    _classes[path] = found  # a registered method's path: as many entries as methods
    return found
