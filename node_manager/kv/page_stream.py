"""Raw TCP page stream between node managers: the data plane beside gRPC's control plane.

gRPC's FetchPages serializes, frames and copies each 4 MiB batch several times on both sides, which
caps its throughput (docs/design-notes.md#page-stream). This stream carries the same content (pages
in layer order, each with its keyed MAC) as fixed binary frames, written straight from staged
tensors and read straight into them (`recv_into`): one kernel copy each way (TLS's too under
`cluster.tls`). gRPC stays the fallback: a peer that advertises no data port, or whose data port
refuses the connection, is read over FetchPages.

Wire format (little-endian):
  request   b"SKV1" u32 length | FetchPagesRequest (protobuf, <= 64 KiB)
  frame     u8 kind, 3 pad bytes, u32 layer, u32 first_block, u32 count, u32 extra
            kind PAGES:   extra = page_bytes; then count u64 checksums, then count pages back to back
                          (count <= pages_per_message(page_bytes): frames stay under 4 MiB)
            kind SESSION: extra = length of the SessionStatus (protobuf, token ids included) that follows
            kind END:     extra = length of a UTF-8 error message that follows (0: the stream is complete)
  A request with `with_session` is answered with a SESSION frame; the receiver then sends a second
  request naming the blocks it wants (or hangs up if it wants none), and the PAGES follow. A pull
  learns the session and gets its pages over one connection, without a gRPC round trip first.

The receiver reads each frame's pages straight into reserved DRAM slots, checks every page's MAC
there (`PageIngest.verify_reserved`, then `install_verified`) under block keys derived from its own
copy of the token ids, so a page is kept only if it matches its own key and layer. A stream that
breaks midway leaves the verified pages stored and the rest missing: never a bad page.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from node_manager.kv.errors import KVStoreError
from node_manager.kv.ingest import PageReservation, VerifiedPages
from node_manager.kv.sessions import SessionRecord
from node_manager.kv.slots import consecutive_runs
from node_manager.kv.store import TieredStore
from node_manager.kv.transfer import (
    loaded_runs,
    pages_per_message,
    session_status,
    staged_load,
    stream_chunks,
    stream_end,
)
from symphony.cluster_tls import server_handshake
from symphony.logs import get_logger
from symphony.rpc import kv_pb2

log = get_logger(__name__)

TLS = ssl.SSLContext | None  # the cluster's context (`symphony.cluster_tls`); None: plaintext
MAGIC = b"SKV1"
_REQUEST = struct.Struct("<4sI")
_FRAME = struct.Struct("<BxxxIIII")
PAGES = 1
END = 2
SESSION = 3
MAX_REQUEST_BYTES = 64 * 1024
MAX_SESSION_BYTES = 16 << 20  # a SessionStatus of ~4M token ids
MAX_ERROR_BYTES = 4096
_CONNECT_TIMEOUT_S = 2.0
# Asked of the kernel for the receiving socket (it caps the request at net.core.rmem_max). The
# receiver checksums and installs each frame before reading the next; with the default buffer the
# sender stalls during that, with a few frames' room it keeps sending (docs/design-notes.md#page-stream).
# Set before connecting, since TCP fixes its window scale at the handshake.
RECEIVE_BUFFER_BYTES = 16 << 20
# Pages received before they are installed together: about eight SmolLM2 layers of a 2,048-token
# session. Larger batches install no faster; smaller ones pay the per-install cost more often.
INSTALL_BATCH_BYTES = 12 << 20
# The most one read of page bytes takes, so that its pages are checksummed soon after they land.
RECEIVE_CHUNK_BYTES = 256 << 10


class ProtocolError(Exception):
    """The other side sent something this protocol does not allow."""


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the page stream")
        got += n


def _recv_bytes(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    _recv_exactly(sock, memoryview(buffer))
    return bytes(buffer)


class PageStreamServer:
    """Serves FetchPages requests over raw TCP: one thread per stream, at most `max_streams` at once
    (a stream beyond that gets an END frame saying so, and the puller falls back to gRPC)."""

    def __init__(
        self, store: TieredStore, host: str, port: int, timeout_s: float, max_streams: int = 8, tls: TLS = None
    ) -> None:
        """`tls`: the cluster's server context: a stream starts with a handshake only a member passes
        (one refused as busy is closed unanswered: its puller falls back to gRPC)."""
        self._store = store
        self._tls = tls
        self._timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_streams)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host.strip("[]"), port), family=family, backlog=64)
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._streams: dict[threading.Thread, socket.socket] = {}
        self._streams_lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-page-stream-accept", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return  # the listener was shut down
                # Out of file descriptors, a connection reset before accept: the stream stays up.
                log.warning("page stream accept failed", error=repr(exc))
                self._closed.wait(0.1)
                continue
            thread: threading.Thread | None = None
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(self._timeout_s)
                if not self._slots.acquire(blocking=False):
                    self._refuse(conn, "busy: too many page streams; retry")
                    continue
                thread = threading.Thread(target=self._serve, args=(conn,), name="kv-page-stream", daemon=True)
                with self._streams_lock:
                    self._streams[thread] = conn
                thread.start()
            except (OSError, RuntimeError) as exc:  # no thread could be started: drop this one connection
                log.warning("page stream could not start", error=repr(exc))
                if thread is not None:  # the slot was taken and _serve will not give it back
                    with self._streams_lock:
                        self._streams.pop(thread, None)
                    self._slots.release()
                conn.close()

    def _refuse(self, conn: socket.socket, message: str) -> None:
        """An END frame saying why, then close; under TLS, no handshake for it: closed unanswered."""
        with contextlib.suppress(OSError):
            conn.sendall(b"" if self._tls is not None else _end_frame(message))
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._tls is not None:
                with self._streams_lock:  # registered before the handshake: close() interrupts it too
                    if self._closed.is_set():
                        return
                    conn = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                    self._streams[threading.current_thread()] = conn
                server_handshake(conn, self._timeout_s)  # a non-member ends here (ssl.SSLError, TimeoutError)
            asked = _read_request(conn)
            # Before anything of the session goes out.
            self._store.check_model(asked.model_fingerprint, "sender")
            request = self._describe_session(conn, asked) if asked.with_session else asked
            if request is None:
                return  # the receiver needed no pages
            self._send_pages(conn, request)
            conn.sendall(_end_frame(""))
        except (KVStoreError, ProtocolError, ValueError, TimeoutError, concurrent.futures.TimeoutError) as exc:
            # Told to the receiver (a load that timed out included), which reports it in its pull.
            with contextlib.suppress(OSError):
                conn.sendall(_end_frame(str(exc) or type(exc).__name__))
        except OSError as exc:
            log.debug("page stream ended early", error=repr(exc))
        except Exception as exc:  # a failed copy in a load: reported, never a dead thread with a stack trace
            log.warning("page stream failed", error=repr(exc))
            with contextlib.suppress(OSError):
                conn.sendall(_end_frame(f"sender failed: {exc!r}"))
        finally:
            conn.close()
            self._slots.release()
            with self._streams_lock:
                self._streams.pop(threading.current_thread(), None)

    def _describe_session(
        self, conn: socket.socket, opening: kv_pb2.FetchPagesRequest
    ) -> kv_pb2.FetchPagesRequest | None:
        """Send the session's status; return the range request that follows (None: the receiver hung up)."""
        status = session_status(self._store, *_session_of(opening), token_ids=True)
        body = status.SerializeToString()
        conn.sendall(_FRAME.pack(SESSION, 0, 0, 0, len(body)) + body)
        try:
            request = _read_request(conn)
        except ConnectionError:
            return None
        if (
            request.session != opening.session
            or request.with_session
            or request.model_fingerprint != opening.model_fingerprint
        ):
            raise ProtocolError("the range request must name the session just described, once, for the same model")
        return request

    def _send_pages(self, conn: socket.socket, request: kv_pb2.FetchPagesRequest) -> None:
        tenant, session_id = _session_of(request)
        store = self._store
        record, end = stream_end(store, tenant, session_id, request.first_block, request.num_blocks or None)
        for chunk_start, count in stream_chunks(store, request.first_block, end):
            with store.pinned_dram_pages(tenant, session_id, chunk_start, count) as held:
                if held is not None:
                    self._send_from_dram(conn, chunk_start, *held)
                    continue
            self._send_loaded(conn, record, chunk_start, count)

    def _send_from_dram(self, conn: socket.socket, chunk_start: int, slots: np.ndarray, checksums: np.ndarray) -> None:
        """The common case: every page sits in DRAM, pinned; each run of consecutive slots goes out
        straight from the arena (saves give a layer's blocks consecutive slots, so usually one run)."""
        page_bytes = self._store.geometry.page_bytes
        per_message = pages_per_message(page_bytes)
        checksums = checksums.astype("<u8")
        for layer in range(slots.shape[1]):
            column = slots[:, layer]
            for run_start, run_stop in consecutive_runs(column):
                for start in range(run_start, run_stop, per_message):
                    stop = min(start + per_message, run_stop)
                    self._send_header(conn, layer, chunk_start + start, checksums[start:stop, layer])
                    conn.sendall(self._store.dram.run_view(int(column[start]), stop - start))

    def _send_loaded(self, conn: socket.socket, record: SessionRecord, chunk_start: int, count: int) -> None:
        """Pages spread over tiers: loaded into staging layer by layer, each layer sent once it is in."""
        store = self._store
        page_bytes = store.geometry.page_bytes
        per_message = pages_per_message(page_bytes)
        checksums = store.page_checksums(record.key[0], record.key[1], chunk_start, count).astype("<u8")
        staging, handle = staged_load(store, record, chunk_start, count)
        try:
            for layer in range(store.geometry.num_layers):
                result = handle.layer_ready(layer).result(self._timeout_s)
                data = staging[layer].numpy().data.cast("B")
                for start, stop in loaded_runs(result, chunk_start, count, per_message):
                    self._send_header(conn, layer, chunk_start + start, checksums[start:stop, layer])
                    conn.sendall(data[start * page_bytes : stop * page_bytes])
        finally:
            handle.cancel()  # a stream that stops early starts no further copies

    def _send_header(self, conn: socket.socket, layer: int, first_block: int, checksums: np.ndarray) -> None:
        """A PAGES frame up to its page bytes, which the caller sends next."""
        conn.sendall(
            _FRAME.pack(PAGES, layer, first_block, len(checksums), self._store.geometry.page_bytes)
            + checksums.tobytes()
        )

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        self._acceptor.join(5)
        with self._streams_lock:
            streams = list(self._streams.items())
        for _, conn in streams:  # a stream blocked on a slow reader ends now, not after its timeout
            with contextlib.suppress(OSError):  # the plain socket's shutdown: a TLS one's keeps its state
                socket.socket.shutdown(conn, socket.SHUT_RDWR)
        for thread, _ in streams:
            thread.join(self._timeout_s)


def _read_request(conn: socket.socket) -> kv_pb2.FetchPagesRequest:
    magic, length = _REQUEST.unpack(_recv_bytes(conn, _REQUEST.size))
    if magic != MAGIC:
        raise ProtocolError("not a Symphony page stream request")
    if length > MAX_REQUEST_BYTES:
        raise ProtocolError(f"request of {length} bytes is over {MAX_REQUEST_BYTES}")
    request = kv_pb2.FetchPagesRequest()
    try:
        request.ParseFromString(_recv_bytes(conn, length))
    except DecodeError as exc:
        raise ProtocolError(f"malformed request: {exc}") from None
    return request


def _session_of(request: kv_pb2.FetchPagesRequest) -> tuple[str, str]:
    tenant, session_id = request.session.tenant, request.session.session_id
    if not tenant or not session_id:
        raise ProtocolError("session.tenant and session.session_id are required")
    return tenant, session_id


def _send_request(sock: socket.socket, request: kv_pb2.FetchPagesRequest) -> None:
    body = request.SerializeToString()
    sock.sendall(_REQUEST.pack(MAGIC, len(body)) + body)


def _end_frame(message: str) -> bytes:
    encoded = message.encode()[:MAX_ERROR_BYTES]
    return _FRAME.pack(END, 0, 0, 0, len(encoded)) + encoded


@dataclass
class StreamOutcome:
    received: int = 0  # pages that arrived whole
    stored: int = 0  # of those, pages the store kept (checksum matched and there was room)
    error: str = ""  # why the stream stopped early; empty if the sender reported it complete
    status: kv_pb2.SessionStatus | None = None  # the sender's description, when the request asked for it


Plan = Callable[[kv_pb2.SessionStatus], kv_pb2.FetchPagesRequest | None]


def fetch_pages(
    store: TieredStore,
    host: str,
    port: int,
    request: kv_pb2.FetchPagesRequest,
    timeout_s: float,
    stop: threading.Event | None = None,
    plan: Plan | None = None,
    tls: TLS = None,
) -> StreamOutcome:
    """Read one page stream into `store` (blocking; run it off the event loop); `stop` set ends it
    at the next frame. Raises OSError only if no connection could be made (a failed TLS handshake
    under `tls`, the cluster's client context, included; a server that refuses our certificate
    under TLS 1.3 shows as an outcome's error instead), so the caller can fall back to gRPC;
    everything after that is an outcome, partial or complete.

    A request `with_session` needs `plan`: it gets the sender's SessionStatus (on this thread, before
    any page) and returns the range to fetch, or None for nothing."""
    if request.with_session and plan is None:
        raise ValueError("a request with_session needs a plan for the pages")
    # A short connect timeout: a port that drops packets should send the caller to gRPC quickly.
    sock = _connect(host.strip("[]"), port, min(timeout_s, _CONNECT_TIMEOUT_S), tls)
    outcome = StreamOutcome()
    try:
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send_request(sock, request)
        if request.with_session:
            assert plan is not None
            outcome.status, outcome.error = _read_session(sock)
            if outcome.status is None:
                return outcome
            planned = plan(outcome.status)
            if planned is None:
                return outcome  # closing the socket tells the sender
            request = planned
            _send_request(sock, request)
        outcome.error = _receive(sock, store, request, outcome, stop or threading.Event())
    except (OSError, ProtocolError, KVStoreError, ValueError) as exc:
        outcome.error = f"page stream broke: {exc}"
    finally:
        sock.close()
    return outcome


def _read_session(sock: socket.socket) -> tuple[kv_pb2.SessionStatus | None, str]:
    """The SESSION frame that answers a request with_session, or (None, the sender's reason)."""
    header = _recv_bytes(sock, _FRAME.size)
    kind, _, _, _, extra = _FRAME.unpack(header)
    if kind == END:
        if extra > MAX_ERROR_BYTES:
            raise ProtocolError(f"error message of {extra} bytes")
        return None, _recv_bytes(sock, extra).decode(errors="replace") if extra else "no session status"
    if kind != SESSION or extra > MAX_SESSION_BYTES:
        raise ProtocolError(f"bad frame: kind {kind} of {extra} bytes where a session status was due")
    status = kv_pb2.SessionStatus()
    try:
        status.ParseFromString(_recv_bytes(sock, extra))
    except DecodeError as exc:
        raise ProtocolError(f"malformed session status: {exc}") from None
    return status, ""


def _connect(host: str, port: int, timeout_s: float, tls: TLS = None) -> socket.socket:
    """`socket.create_connection`, with the receive buffer enlarged before the handshake (TCP's,
    then TLS's under `tls`, checking the peer's certificate names `host`)."""
    error: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
            sock.settimeout(timeout_s)
            sock.connect(address)
            return sock if tls is None else tls.wrap_socket(sock, server_hostname=host)
        except OSError as exc:
            sock.close()
            error = exc
    raise error or OSError(f"no address for {host}:{port}")


def _receive(
    sock: socket.socket,
    store: TieredStore,
    request: kv_pb2.FetchPagesRequest,
    outcome: StreamOutcome,
    stop: threading.Event,
) -> str:
    """Read frames into reserved DRAM slots until the sender's END. Each frame's pages are
    checksummed as soon as they are in, still in the CPU cache (docs/design-notes.md#page-stream),
    and installed a few layers at a time (one install for the layers of a block range costs about
    what one layer alone did). Whatever arrived whole is installed even when the stream breaks, so
    a cut transfer leaves a partial result and never a half-written page."""
    verified: list[VerifiedPages] = []
    try:
        return _receive_frames(sock, store, request, outcome, stop, verified)
    finally:
        _install(store, verified, outcome)


def _install(store: TieredStore, verified: list[VerifiedPages], outcome: StreamOutcome) -> None:
    batch = verified[:]
    verified.clear()
    outcome.stored += store.ingest.install_verified(batch)


def _receive_frames(
    sock: socket.socket,
    store: TieredStore,
    request: kv_pb2.FetchPagesRequest,
    outcome: StreamOutcome,
    stop: threading.Event,
    verified: list[VerifiedPages],
) -> str:
    page_bytes = store.geometry.page_bytes
    max_pages = pages_per_message(page_bytes)
    header = bytearray(_FRAME.size)
    tenant, session_id = request.session.tenant, request.session.session_id
    end = request.first_block + request.num_blocks if request.num_blocks else 0
    install_pages = max(1, INSTALL_BATCH_BYTES // page_bytes)
    pending_pages = 0
    while not stop.is_set():
        _recv_exactly(sock, memoryview(header))
        kind, layer, first_block, count, extra = _FRAME.unpack(header)
        if kind == END:
            if extra > MAX_ERROR_BYTES:
                raise ProtocolError(f"error message of {extra} bytes")
            return _recv_bytes(sock, extra).decode(errors="replace") if extra else ""
        if kind != PAGES or extra != page_bytes or not 0 < count <= max_pages:
            raise ProtocolError(
                f"bad frame: kind {kind}, {count} pages of {extra} bytes "
                f"(expected pages of {page_bytes} bytes, at most {max_pages})"
            )
        if first_block < request.first_block or (end and first_block + count > end):
            raise ProtocolError(f"bad frame: blocks {first_block}..{first_block + count - 1} were not asked for")
        checksums = np.frombuffer(_recv_bytes(sock, count * 8), "<u8").tolist()
        # The pages go straight into reserved DRAM slots.
        reservation = store.ingest.reserve_pages(tenant, session_id, layer, first_block, count)
        if reservation is None:  # no room in DRAM: read past the pages
            _discard(sock, count * page_bytes)
            outcome.received += count
            continue
        try:
            actual = _recv_checksummed(sock, store, reservation)
            verified.append(store.ingest.verify_reserved(reservation, checksums, actual))
        except BaseException:
            store.ingest.release_pages(reservation)
            raise
        outcome.received += count
        pending_pages += count
        # Installed here: another thread gains nothing while the GIL and the sender want the same
        # CPUs (docs/design-notes.md#page-stream), and meanwhile the socket buffer keeps the sender going.
        if pending_pages >= install_pages:
            _install(store, verified, outcome)
            pending_pages = 0
    return "pull cancelled"


def _recv_checksummed(sock: socket.socket, store: TieredStore, reservation: PageReservation) -> list[int]:
    """Receive a reservation's pages into its DRAM slots and checksum each page as soon as it is
    whole, while the bytes just written are likelier to be in the CPU cache
    (docs/design-notes.md#page-stream)."""
    page_bytes = store.geometry.page_bytes
    checksums: list[int] = []
    for view in store.ingest.reserved_views(reservation):
        got = checked = 0
        while got < len(view):
            n = sock.recv_into(view[got : got + RECEIVE_CHUNK_BYTES])
            if n == 0:
                raise ConnectionError("peer closed the page stream")
            got += n
            whole = got - got % page_bytes
            if whole > checked:
                checksums += store.ingest.reserved_checksums(reservation, len(checksums), view[checked:whole])
                checked = whole
    return checksums


def _discard(sock: socket.socket, size: int) -> None:
    scratch = memoryview(bytearray(min(size, 1 << 20)))
    while size:
        chunk = scratch[: min(size, len(scratch))]
        _recv_exactly(sock, chunk)
        size -= len(chunk)
