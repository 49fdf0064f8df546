"""The node-local KV channel, connector side: a blocking client of `node_manager.kv.ipc_server`.

One client is one Unix-socket connection and is used by one thread at a time (requests on a
connection are answered in order); the connector keeps one per thread that talks to the node
manager. Errors from the node manager arrive as `KVChannelError`; a connection that breaks is
reopened on the next call, and the node manager releases whatever the broken one held.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from node_manager.kv import ipc_wire


class KVChannelError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def registration_frame(tenant: str, session: str, token_ids: Sequence[int] | np.ndarray, warmup: bool = False) -> bytes:
    """The `register` operation as bytes to send (see `NodeKVClient.register`)."""
    header: dict[str, Any] = {"op": "register", "tenant": tenant, "session": session}
    if warmup:
        header["warmup"] = True
    return ipc_wire.encode(header, ipc_wire.token_payload(token_ids))


class NodeKVClient:
    def __init__(self, path: str | Path, timeout_s: float = 10.0) -> None:
        self.path = str(path)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self.connections = 0  # connections opened so far: a new one may reach a restarted node manager

    def _connection(self) -> socket.socket:
        if self._sock is None:
            self.connections += 1
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _call(self, message: dict[str, Any], payload: bytes = b"", reply: bool = True) -> tuple[dict[str, Any], bytes]:
        sock = self._connection()
        try:
            ipc_wire.send(sock, message, payload)
            if not reply:
                return {}, b""
            return self._read(sock)
        except (OSError, ipc_wire.ProtocolError):
            self.close()  # the next call reconnects; the node manager released what this one held
            raise

    def _read(self, sock: socket.socket) -> tuple[dict[str, Any], bytes]:
        frame = ipc_wire.recv(sock)
        if frame is None:
            raise ConnectionError("the node manager closed the KV channel")
        message, payload = frame
        if message["op"] == "error":
            raise KVChannelError(str(message.get("code")), str(message.get("message")))
        return message, payload

    def hello(self) -> dict[str, Any]:
        return self._call({"op": "hello"})[0]

    def register(self, tenant: str, session: str, token_ids: Sequence[int] | np.ndarray, warmup: bool = False) -> None:
        """Tell the node manager a request's history (no reply): its loads and saves address the
        session's blocks. `warmup`: the request is the node manager's engine warm-up, not the
        session's next turn. How much of the history the tiers hold is read from the block index
        (`node_manager.connector.lookup`), not asked."""
        self.send_frames(registration_frame(tenant, session, token_ids, warmup))

    def send_frames(self, frames: bytes) -> None:
        """Send frames encoded beforehand (operations with no reply), in one write."""
        sock = self._connection()
        try:
            sock.sendall(frames)
        except OSError:
            self.close()
            raise

    def load(
        self, items: Sequence[dict[str, Any]], timeout_s: float = 30.0
    ) -> tuple[int, Iterator[tuple[int, np.ndarray]]]:
        """Start a load of `items` ({tenant, session, first_block, count}); returns its id and an
        iterator of (layer, slots), layers in order, slots for every item's blocks concatenated
        (-1: recompute). Read the iterator to its end before any other call, then `release`."""
        request_id = next(self._ids)
        sock = self._connection()
        try:
            ipc_wire.send(sock, {"op": "load", "id": request_id, "items": list(items), "timeout_s": timeout_s})
        except OSError:
            self.close()
            raise
        return request_id, self._layers(sock, request_id)

    def _layers(self, sock: socket.socket, request_id: int) -> Iterator[tuple[int, np.ndarray]]:
        try:
            while True:
                message, payload = self._read(sock)
                if message["op"] != "layer":
                    raise ipc_wire.ProtocolError(f"expected a layer frame, got {message['op']!r}")
                if message.get("id") != request_id:  # an earlier load's frame: that answer was not read out
                    raise ipc_wire.ProtocolError(f"a layer frame of load {message.get('id')!r}, not {request_id}")
                yield int(message["layer"]), ipc_wire.slots_from(payload)
                if message.get("last"):
                    return
        except (OSError, ipc_wire.ProtocolError):
            self.close()
            raise

    def release(self, load_id: int) -> None:
        self._call({"op": "release", "id": load_id}, reply=False)

    def reserve(
        self, tenant: str, session: str, first_block: int, count: int, token_ids: Sequence[int]
    ) -> tuple[int, np.ndarray]:
        """DRAM slots for blocks first_block.. of every layer ([layers, count], -1: no room), for
        the caller to fill; `token_ids` is the session's history through the end of those blocks."""
        request_id = next(self._ids)
        _, payload = self._call(
            {
                "op": "reserve",
                "id": request_id,
                "tenant": tenant,
                "session": session,
                "first_block": first_block,
                "count": count,
            },
            ipc_wire.token_payload(token_ids),
        )
        return request_id, ipc_wire.slots_from(payload).reshape(-1, count) if count else np.empty((0, 0), np.int64)

    def commit(self, reservation_id: int) -> int:
        return int(self._call({"op": "commit", "id": reservation_id})[0]["kept"])

    def abort(self, reservation_id: int) -> None:
        self._call({"op": "abort", "id": reservation_id}, reply=False)

    def report(
        self,
        *,
        prompt_tokens: dict[str, int] | None = None,
        load_error_blocks: int = 0,
        layer_waits_s: Sequence[float] = (),
    ) -> None:
        """Send what only the connector sees to the node's metrics (no reply)."""
        self._call(
            {
                "op": "report",
                "prompt_tokens": prompt_tokens or {},
                "load_error_blocks": load_error_blocks,
                "layer_waits_s": list(layer_waits_s),
            },
            reply=False,
        )

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
