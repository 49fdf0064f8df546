"""Framing of the node-local KV channel between the node manager and the vLLM connector.

A frame is a fixed header `<II` (JSON length, payload length), a small JSON object naming the
operation and its arguments, then an opaque binary payload (token ids as uint32, slot numbers as
int64). JSON keeps the operations readable and extensible; the payload keeps the bulk (thousands of
token ids or slots) out of it, so a lookup costs tens of microseconds, not a JSON list walk. The
channel is a Unix socket: local only, guarded by file permissions, no network stack.
"""

from __future__ import annotations

import array
import json
import socket
import struct
from typing import Any, Literal, overload

import numpy as np

HEADER = struct.Struct("<II")
MAX_JSON_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024  # 8 M slots or 16 M token ids: far above any real request
# Where an admitted prompt's KV came from, as the connector reports it (`report` op).
PROMPT_TOKEN_SOURCES = ("engine_cache", "symphony", "computed")
# In a request's kv_transfer_params: the node manager's engine warm-up of a prefetched session
# (node_manager.engine_warmup), which the connector tells apart from the session's next turn.
WARMUP_PARAM = "symphony_warmup"
WARMUP_PRIORITY_PARAM = "symphony_priority"  # the session's priority tier (int Priority): its blocks' yielding order

assert array.array("I").itemsize == 4, "token payloads are uint32"


class ProtocolError(Exception):
    """The peer sent something that is not a frame of this protocol (or closed mid-frame)."""


def encode(message: dict[str, Any], payload: bytes | memoryview = b"") -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return HEADER.pack(len(body), len(payload)) + body + bytes(payload)


def send(sock: socket.socket, message: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    sock.sendall(encode(message, payload))


def recv(sock: socket.socket) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None when the peer closed the connection between frames."""
    head = _recv_exact(sock, HEADER.size, allow_eof=True)
    if head is None:
        return None
    body_len, payload_len = HEADER.unpack(head)
    if body_len > MAX_JSON_BYTES or payload_len > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"frame too large ({body_len} + {payload_len} bytes)")
    body = _recv_exact(sock, body_len)
    payload = _recv_exact(sock, payload_len) if payload_len else b""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, an int past 4300 digits, too deep
        raise ProtocolError(f"frame header is not JSON: {exc!r}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("frame header has no 'op'")
    return message, payload


@overload
def _recv_exact(sock: socket.socket, count: int, allow_eof: Literal[False] = False) -> bytes: ...
@overload
def _recv_exact(sock: socket.socket, count: int, allow_eof: bool) -> bytes | None: ...
def _recv_exact(sock: socket.socket, count: int, allow_eof: bool = False) -> bytes | None:
    """`count` bytes; None only with `allow_eof`, for a peer that closed before sending any."""
    buffer = bytearray(count)
    view = memoryview(buffer)
    got = 0
    while got < count:
        n = sock.recv_into(view[got:])
        if n == 0:
            if allow_eof and got == 0:
                return None
            raise ProtocolError("connection closed mid-frame")
        got += n
    return bytes(buffer)


def token_payload(token_ids: Any) -> bytes:
    if isinstance(token_ids, np.ndarray):
        return np.ascontiguousarray(token_ids, dtype=np.uint32).tobytes()
    # A list (what vLLM hands the connector): array() converts it ~6x faster than numpy, and this
    # runs once per request on vLLM's scheduling path.
    return array.array("I", token_ids).tobytes()


def tokens_from(payload: bytes) -> np.ndarray:
    """A read-only uint32 view of the payload (what `token_array` makes), no per-token objects."""
    if len(payload) % 4:
        raise ProtocolError("token payload is not a whole number of uint32")
    return np.frombuffer(payload, dtype="<u4")


def slots_from(payload: bytes) -> np.ndarray:
    if len(payload) % 8:
        raise ProtocolError("slot payload is not a whole number of int64")
    return np.frombuffer(payload, dtype=np.int64)
