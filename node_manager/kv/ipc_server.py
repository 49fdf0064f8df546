"""The node-local KV channel, node manager side: serves the vLLM connector over a Unix socket.

The connector runs inside vLLM's processes (scheduler and worker) on the same host and maps the
DRAM arena itself, so this channel carries bookkeeping only, never page bytes:

- `hello`: the arena's and the block index's names and the KV geometry, so the worker can map and
  check the arena and the scheduler side can map the index (`node_manager.kv.block_index`): how
  many leading blocks of a history some tier holds in every layer is read there, not asked here.
- `register` (+ token ids, no reply): the session's tokens, so that its loads, saves and prefetch
  warm-ups know its blocks; counts a prefetched session's arrival.
- `load` (items of blocks): per layer, in layer order, one `layer` frame with the DRAM slot of
  every block (-1: not available, recompute it), pinned until `release`. Pages on SSD are promoted
  into DRAM first, layer by layer, so the worker copies layer 0 while later layers are still read.
- `reserve` (+ token ids) / `commit` / `abort`: DRAM slots that the worker fills with a layer's
  new pages straight from vLLM's KV cache; `commit` checksums and installs them (write-behind to
  SSD follows as for every save).
- `report` (no reply): what only the connector sees, for the node's metrics: where admitted
  prompt tokens' KV came from, blocks whose load failed, how long the forward waited per layer.

Requests on one connection are answered in order. A connection that closes gives back its pins and
reservations `DROPPED_HOLD_S` later (a CUDA engine's copies from or into them may still be
running), so a worker killed mid-step leaks nothing; `close` gives back what is held at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from node_manager.kv import ipc_wire
from node_manager.kv.errors import InvalidRequest, KVStoreError, SessionNotFound
from node_manager.kv.ingest import PageReservation
from node_manager.kv.pages import Tier
from node_manager.kv.prefetch import PrefetchQueue
from node_manager.kv.store import DramPin, TieredStore
from symphony.kv_addressing import BLOCK_KEY_BYTES, BlockKey
from symphony.logs import get_logger

log = get_logger(__name__)

MAX_CONNECTIONS = 64
MAX_OUTSTANDING = 1024  # loads plus reservations one connection may hold at once
MAX_LOAD_ITEMS = 1024
DEFAULT_LOAD_TIMEOUT_S = 30.0


@dataclass(eq=False)  # kept in a set: identity, not field equality
class _Connection:
    sock: socket.socket
    loads: dict[int, list[DramPin]] = field(default_factory=dict)
    reservations: dict[int, list[PageReservation | None]] = field(default_factory=dict)
    tails: dict[int, int] = field(default_factory=dict)  # reservation id -> its partial tail's tokens


NO_REPLY_OPS = frozenset({"register", "release", "abort", "report"})
MAX_REPORTED_WAITS = 4096  # layer waits one report may carry
# A load may arrive (from the worker's connection) before the registration of its session (sent by
# the scheduler side on another connection) was handled: it waits this long for it at most.
REGISTRATION_WAIT_S = 1.0
# A connection that ends holding pinned or reserved pages (its worker died, or the channel broke
# mid-step) may have device copies still running from or into them (a CUDA engine's are
# asynchronous): the pages go back to the store this long after, not at once.
DROPPED_HOLD_S = 2.0


class LocalKVServer:
    def __init__(
        self,
        store: TieredStore,
        path: Path,
        max_connections: int = MAX_CONNECTIONS,
        prefetches: PrefetchQueue | None = None,
        registration_wait_s: float = REGISTRATION_WAIT_S,
        dropped_hold_s: float = DROPPED_HOLD_S,
        params_key: bytes = b"",
    ) -> None:
        self.store = store
        self._params_key = params_key  # handed to the connector at hello: it checks requests' params
        self.dropped_hold_s = dropped_hold_s
        self.registration_wait_s = registration_wait_s
        self.loads_awaiting_registration = 0  # loads waiting right now for their session's registration
        self.prefetches = prefetches  # set once the runtime has its queue: prefetch hits are counted at match
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a node manager killed with -9 leaves its socket behind; the path is ours
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        os.chmod(self.path, 0o600)  # only this user's processes may read the store's bookkeeping
        self._listener.listen(max_connections)
        self._max_connections = max_connections
        self._connections: set[_Connection] = set()
        self._lock = threading.Lock()
        self._registered = threading.Condition()  # notified after each registration
        # Dropped connections' pages, held back (DROPPED_HOLD_S) until their timer gives them back;
        # at most one entry per connection that ended holding pages (under _lock).
        self._held_back: dict[threading.Timer, tuple[list[DramPin], list[PageReservation | None]]] = {}
        self._closed = False
        self._accepter = threading.Thread(target=self._accept_loop, name="kv-ipc-accept", daemon=True)
        self._accepter.start()

    # ---- connections ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                log.warning("KV channel accept failed; still listening")
                time.sleep(0.01)  # an error that repeats (fd exhaustion) must not spin a core
                continue
            conn = _Connection(sock)
            with self._lock:
                full = len(self._connections) >= self._max_connections
                if not full:
                    self._connections.add(conn)
            if full:
                with contextlib.suppress(OSError):
                    ipc_wire.send(
                        sock,
                        {"op": "error", "code": "busy", "message": f"more than {self._max_connections} connections"},
                    )
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-ipc-conn", daemon=True).start()

    def _serve(self, conn: _Connection) -> None:
        try:
            while True:
                frame = ipc_wire.recv(conn.sock)
                if frame is None:
                    return
                message, payload = frame
                try:
                    self._dispatch(conn, message, payload)
                except (InvalidRequest, ipc_wire.ProtocolError, ValueError, TypeError, KeyError) as exc:
                    self._error(conn, message, "invalid_argument", str(exc))
                except SessionNotFound as exc:
                    self._error(conn, message, "not_found", str(exc))
                except KVStoreError as exc:
                    self._error(conn, message, "unavailable", str(exc))
        except ipc_wire.ProtocolError as exc:
            log.warning("KV channel peer sent a bad frame; closing it", error=str(exc))
        except OSError:
            pass  # the peer went away: what it held is released below
        finally:
            self._drop(conn)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    @property
    def held_back(self) -> int:
        """Pins and reservations of ended connections not yet given back (DROPPED_HOLD_S)."""
        with self._lock:
            return sum(len(pins) + len(reservations) for pins, reservations in self._held_back.values())

    def _drop(self, conn: _Connection) -> None:
        pins = [pin for held in conn.loads.values() for pin in held]
        reservations = [r for held in conn.reservations.values() for r in held]
        conn.loads.clear()
        conn.reservations.clear()
        conn.tails.clear()
        with contextlib.suppress(OSError):
            conn.sock.close()
        with self._lock:
            self._connections.discard(conn)
            hold = bool(pins or reservations) and not self._closed and self.dropped_hold_s > 0
            if hold:
                timer = threading.Timer(self.dropped_hold_s, lambda: self._give_back_held(timer))
                timer.daemon = True
                self._held_back[timer] = (pins, reservations)
                timer.start()
        if not hold:
            self._give_back(pins, reservations)

    def _give_back_held(self, timer: threading.Timer) -> None:
        with self._lock:
            held = self._held_back.pop(timer, None)
        if held is not None:  # not given back by close() meanwhile
            self._give_back(*held)

    def _give_back(self, pins: list[DramPin], reservations: list[PageReservation | None]) -> None:
        if self.store.closed:
            return  # its pages are gone with it
        for pin in pins:
            self.store.unpin_dram(pin)
        self._release(reservations)

    def _error(self, conn: _Connection, message: dict[str, Any], code: str, text: str) -> None:
        if message.get("op") in NO_REPLY_OPS:
            # The client reads no reply to these: an error frame would answer its next call instead.
            log.warning("KV channel request refused", op=message.get("op"), code=code, error=text)
            return
        ipc_wire.send(conn.sock, {"op": "error", "id": message.get("id"), "code": code, "message": text})

    # ---- operations -------------------------------------------------------------------------------

    def _dispatch(self, conn: _Connection, message: dict[str, Any], payload: bytes) -> None:
        op = message["op"]
        if op == "hello":
            g = self.store.geometry
            ipc_wire.send(
                conn.sock,
                {
                    "op": "hello",
                    "arena": self.store.dram.name,
                    "block_index": self.store.block_index.name,
                    "arena_bytes": self.store.config.dram_bytes,
                    "num_layers": g.num_layers,
                    "kv_heads": g.kv_heads,
                    "head_size": g.head_size,
                    "block_size": g.block_size,
                    "dtype": g.dtype,
                    "page_bytes": g.page_bytes,
                    "model_fingerprint": self.store.model.hex(),
                    "params_key": self._params_key.hex(),
                },
            )
        elif op == "register":
            tenant, session = _str(message, "tenant"), _str(message, "session")
            self.store.sessions.put(tenant, session, ipc_wire.tokens_from(payload))
            with self._registered:
                self._registered.notify_all()
            if not message.get("warmup"):  # a warm-up is the prefetch's own last step, not the arrival
                self._count_prefetch_arrival(tenant, session)
        elif op == "load":
            self._load(conn, message)
        elif op == "release":
            for pin in conn.loads.pop(_int(message, "id"), []):
                self.store.unpin_dram(pin)
        elif op == "reserve":
            self._reserve(conn, message, payload)
        elif op == "commit":
            reservations = conn.reservations.pop(_int(message, "id"), None)
            if reservations is None:
                raise InvalidRequest(f"no reservation {message['id']}")
            kept = self.store.ingest.commit_many([(r, None) for r in reservations if r is not None])
            tail = conn.tails.pop(message["id"], 0)
            if tail and kept == len(reservations):  # every layer of the one partial block kept
                self.store.metrics.connector_tail_tokens_saved.inc(tail)
            ipc_wire.send(conn.sock, {"op": "commit", "id": message["id"], "kept": kept})
        elif op == "abort":
            self._release(conn.reservations.pop(_int(message, "id"), []))
            conn.tails.pop(message["id"], None)
        elif op == "report":
            self._report(message)
        else:
            raise InvalidRequest(f"unknown operation {op!r}")

    def _count_prefetch_arrival(self, tenant: str, session: str) -> None:
        job = self.prefetches.claim_arrival((tenant, session)) if self.prefetches is not None else None
        if job is None:
            return
        loadable_blocks = self.store.loadable_prefix_blocks(tenant, session)
        in_target = self.store.residency(tenant, session)[job.target]
        ready = loadable_blocks > 0 and all(all(layer[:loadable_blocks]) for layer in in_target)
        self.store.metrics.prefetch_arrivals.labels("yes" if ready else "no").inc()

    def _report(self, message: dict[str, Any]) -> None:
        metrics = self.store.metrics
        tokens = message.get("prompt_tokens", {})
        if not isinstance(tokens, dict):
            raise InvalidRequest("'prompt_tokens' must be an object")
        for source in ipc_wire.PROMPT_TOKEN_SOURCES:
            if source in tokens:
                metrics.connector_prompt_tokens.labels(source).inc(_int(tokens, source))
        if "load_error_blocks" in message:
            metrics.connector_load_errors.inc(_int(message, "load_error_blocks"))
        waits = message.get("layer_waits_s", [])
        if not isinstance(waits, list) or len(waits) > MAX_REPORTED_WAITS:
            raise InvalidRequest(f"'layer_waits_s' must be a list of at most {MAX_REPORTED_WAITS} numbers")
        for wait in waits:
            if not isinstance(wait, int | float) or not 0 <= wait < 3600:
                raise InvalidRequest("layer waits must be seconds in [0, 3600)")
            metrics.connector_layer_wait.observe(wait)

    def _check_room(self, conn: _Connection, request_id: int) -> None:
        if request_id in conn.loads or request_id in conn.reservations:
            raise InvalidRequest(f"id {request_id} is already in use on this connection")
        if len(conn.loads) + len(conn.reservations) >= MAX_OUTSTANDING:
            raise InvalidRequest(f"more than {MAX_OUTSTANDING} loads and reservations outstanding")

    def _load(self, conn: _Connection, message: dict[str, Any]) -> None:
        """Answer one `layer` frame per layer, in order. Items wholly in DRAM are pinned at once;
        others are promoted into DRAM by a layer-wise load and pinned as each layer lands. A block
        that cannot be had (unknown session, a page lost, the store busy) gets slot -1."""
        request_id = _int(message, "id")
        self._check_room(conn, request_id)
        items = message["items"]
        if not isinstance(items, list) or len(items) > MAX_LOAD_ITEMS:
            raise InvalidRequest(f"'items' must be a list of at most {MAX_LOAD_ITEMS} loads")
        parsed = [
            (
                _str(item, "tenant"),
                _str(item, "session"),
                _int(item, "first_block"),
                _int(item, "count"),
                _block_key(item),
                _optional_int(item, "tail_tokens"),
            )
            for item in items
        ]
        deadline = time.monotonic() + float(message.get("timeout_s", DEFAULT_LOAD_TIMEOUT_S))
        layers = list(range(self.store.geometry.num_layers))
        pins: list[DramPin] = []
        conn.loads[request_id] = pins
        whole: dict[int, np.ndarray] = {}  # item -> [count, layers] slots, pinned up front
        promoting: dict[int, Any] = {}  # item -> LayerwiseLoad into DRAM
        for index, (tenant, session, first, count, key, tail) in enumerate(parsed):
            self._await_registration(
                tenant, session, first, count, key, tail, min(deadline, time.monotonic() + self.registration_wait_s)
            )
            try:
                # All or nothing: a partly held item is counted (hits, misses) by its load below, once.
                pin = self.store.pin_dram(
                    tenant, session, first, count, layers, whole=True, last_key=key, tail_tokens=tail
                )
            except KVStoreError as exc:
                log.info("KV load item not served; the engine recomputes it", session=session, error=str(exc))
                whole[index] = np.full((count, len(layers)), -1, np.int64)
                continue
            if pin.complete:
                pins.append(pin)
                whole[index] = pin.slots
                continue
            try:
                promoting[index] = self.store.loads.promote(
                    tenant, session, first, count, tier=Tier.DRAM, last_key=key, tail_tokens=tail
                )
            except KVStoreError:
                whole[index] = np.full((count, len(layers)), -1, np.int64)
        delivered = [np.ones(item[3], bool) for item in parsed]  # blocks with every layer so far
        for layer in layers:
            parts = []
            for index, (tenant, session, first, count, key, tail) in enumerate(parsed):
                if index in whole:
                    parts.append(whole[index][:, layer])
                    delivered[index] &= whole[index][:, layer] >= 0
                    continue
                with contextlib.suppress(concurrent.futures.TimeoutError, KVStoreError, OSError):
                    promoting[index].layer_ready(layer).result(max(0.0, deadline - time.monotonic()))
                try:
                    pin = self.store.pin_dram(
                        tenant, session, first, count, [layer], record_reads=False, last_key=key, tail_tokens=tail
                    )
                except KVStoreError:
                    parts.append(np.full(count, -1, np.int64))
                    continue
                pins.append(pin)
                parts.append(pin.slots[:, 0])
                delivered[index] &= pin.slots[:, 0] >= 0
            slots = np.concatenate(parts) if parts else np.empty(0, np.int64)
            last = layer == layers[-1]
            if last:  # counted before the worker can finish the step: a client sees it with its answer
                self._count_loaded(delivered, promoting, [item[5] for item in parsed])
            ipc_wire.send(
                conn.sock,
                {"op": "layer", "id": request_id, "layer": layer, "last": last},
                np.ascontiguousarray(slots, dtype=np.int64).tobytes(),
            )

    def _await_registration(
        self,
        tenant: str,
        session: str,
        first: int,
        count: int,
        last_key: BlockKey | None,
        tail_tokens: int,
        deadline: float,
    ) -> None:
        """Wait until the session is registered with blocks first.. (`SessionRegistry.addresses`), or
        until `deadline`. The scheduler side registers a request's history on its own connection
        without waiting for an answer, so the worker's load of it can come first. Past the deadline
        the load goes ahead: what the store cannot match is recomputed."""

        def registered() -> bool:
            return self.store.sessions.addresses(tenant, session, first, count, last_key, tail_tokens)

        with self._registered:
            if registered():
                return
            self.loads_awaiting_registration += 1
            try:
                self._registered.wait_for(registered, max(0.0, deadline - time.monotonic()))
            finally:
                self.loads_awaiting_registration -= 1

    def _count_loaded(self, delivered: list[np.ndarray], promoting: dict[int, Any], tails: list[int]) -> None:
        """Tokens of the blocks delivered in every layer, by the tier their item was served from (an
        item's partial last block counts its tokens only)."""
        block_size = self.store.geometry.block_size
        for index, blocks in enumerate(delivered):
            tier = Tier.SSD if index in promoting else Tier.DRAM
            tokens = int(blocks.sum()) * block_size
            if tails[index] and len(blocks) and blocks[-1]:
                tokens -= block_size - tails[index]
            self.store.metrics.connector_tokens_loaded.labels(tier.name).inc(tokens)

    def _reserve(self, conn: _Connection, message: dict[str, Any], payload: bytes) -> None:
        request_id = _int(message, "id")
        self._check_room(conn, request_id)
        tenant, session = _str(message, "tenant"), _str(message, "session")
        first, count = _int(message, "first_block"), _int(message, "count")
        record = self.store.sessions.put(tenant, session, ipc_wire.tokens_from(payload))
        # Pinned to this history: a registration of another one in the meantime must not get these pages.
        keys = record.blocks.block_keys
        last_key = keys[first + count - 1] if count and first + count <= len(keys) else None
        # The tokens end mid-block and the reservation reaches past the full blocks: its last block
        # is the history's partial tail (a finished turn's), keyed by its tokens (`tail_key`).
        tail = len(record.token_ids) % self.store.geometry.block_size if first + count > len(keys) else 0
        reservations: list[PageReservation | None] = []
        try:
            for layer in range(self.store.geometry.num_layers):
                reservations.append(
                    self.store.ingest.reserve_pages(tenant, session, layer, first, count, last_key, tail_tokens=tail)
                )
        except BaseException:
            self._release(reservations)
            raise
        conn.reservations[request_id] = reservations
        if tail:
            conn.tails[request_id] = tail
        slots = np.array([r.slots if r is not None else [-1] * count for r in reservations], np.int64)
        ipc_wire.send(conn.sock, {"op": "reserve", "id": request_id}, slots.tobytes())

    def _release(self, reservations: list[PageReservation | None]) -> None:
        for reservation in reservations:
            if reservation is not None:
                self.store.ingest.release_pages(reservation)

    def close(self) -> None:
        """Stop serving: open connections end (their threads give back what they held), and pages
        held back from ended ones go back now."""
        with self._lock:
            self._closed = True
            held_back, self._held_back = self._held_back, {}
        for timer, held in held_back.items():
            timer.cancel()
            self._give_back(*held)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)  # its thread then releases what it held
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _str(message: dict[str, Any], name: str) -> str:
    value = message.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name!r} must be a non-empty string")
    return value


def _block_key(item: dict[str, Any]) -> BlockKey | None:
    """A load item's optional `key`: the hex block key of its last block."""
    value = item.get("key")
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 2 * BLOCK_KEY_BYTES:
        raise InvalidRequest(f"'key' must be a block key in {2 * BLOCK_KEY_BYTES} hex digits")
    try:
        return BlockKey(bytes.fromhex(value))
    except ValueError:
        raise InvalidRequest("'key' is not hexadecimal") from None


def _optional_int(message: dict[str, Any], name: str) -> int:
    """A non-negative integer field that may be left out (0)."""
    return _int(message, name) if name in message else 0


def _int(message: dict[str, Any], name: str) -> int:
    value = message.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"{name!r} must be a non-negative integer")
    return value
