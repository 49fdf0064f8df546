"""The connector's worker side: moves pages between vLLM's paged KV cache and the node's DRAM arena.

Loads: the node manager answers a step's loads layer by layer with the arena slot of each page
(pinned until released); a loader thread copies each layer into vLLM's blocks as its slots arrive
and marks the layer ready, so the forward runs layer l's attention while later layers still come.
A page with no slot (lost, evicted, corrupt on SSD) is reported as a load error: vLLM recomputes
from that block on, never reads garbage.
Saves: the step's new full blocks get DRAM slots reserved for every layer (one round trip), each
layer's pages are copied into them right after vLLM computed that layer, and the reservation is
committed after the forward by a background thread (checksums and write-behind happen in the node
manager). Pages are out of vLLM's blocks by the end of the step, so block frees never wait on us.
A finished request's partial last block is copied, all layers at once, after the next step's
forward; vLLM frees that request's blocks once `saved_tails` reports it.
Metrics: each step's per-layer waits and failed blocks go to the node manager by the same thread.

On a CUDA engine every copy is asynchronous, and nothing may act on pages before their bytes have
landed. Loads run on a stream of their own, behind the work the forward had queued when the step's
loads started. A layer is ready once its copies are queued there; `wait_layer` makes the forward's
stream wait for them on the GPU (the forward's thread does not block on the copies), and the step's
pages go back to the node manager only once every copy is done. Tails are copied on the forward's
stream and waited for before the forward. Saves are queued on the forward's own stream (so later
kernels cannot overwrite a block before it is copied), and their commit waits for an event recorded
after them: the node manager checksums and persists what is in the arena at commit.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from node_manager.connector.kv_client import KVChannelError, NodeKVClient
from node_manager.connector.lookup import check_hello_model
from node_manager.connector.plan import LoadSpec, SaveSpec, TailSave
from node_manager.kv.loader import single_threaded_torch
from node_manager.kv.slots import DramArena, copy_rows
from symphony.kv_addressing import ModelFingerprint
from symphony.kv_geometry import KVGeometry, page_layout
from symphony.logs import get_logger

log = get_logger(__name__)

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
MAX_PENDING_COMMITS = 64
# Finished request ids vLLM told this worker of, kept until their tail save is reported: vLLM
# accepts a finished save only for an id it has named (`get_finished`). One step names at most
# max_num_seqs of them; older ones are long reported.
MAX_KEPT_FINISHED_IDS = 4096
CLOSE_JOIN_S = 10.0  # how long `close` waits for each of the worker side's threads


def layer_index(layer_name: str) -> int:
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise ValueError(f"cannot tell the layer index of {layer_name!r}")
    return int(match.group(1))


class _StepLoad:
    """One step's loads: per-layer readiness and the vLLM blocks that could not be loaded.

    `lock` is held by the loader thread while it copies a layer (on a CPU cache, until the bytes
    have landed; on CUDA, until they are queued) and by the forward when it gives up waiting: once
    `abandoned` is set, no copy is started into blocks that vLLM now recomputes."""

    def __init__(self, num_layers: int, block_ids: np.ndarray, queued: torch.cuda.Event | None) -> None:
        self.ready = [threading.Event() for _ in range(num_layers)]
        self.block_ids = block_ids  # every vLLM block this step loads into, in item order
        self.queued = queued  # CUDA: recorded on the forward's stream when the loads started
        self.lock = threading.Lock()
        self.abandoned = False
        # CUDA: per layer, an event on the load stream after that layer's copies (set before `ready`)
        self.landed: list[torch.cuda.Event | None] = [None] * num_layers


@dataclass(frozen=True, slots=True)
class _Commit:
    reservation: int
    copied: torch.cuda.Event | None  # CUDA: recorded after the reservation's device-to-host copies


def cache_page_layout(kv: torch.Tensor, geometry: KVGeometry, kv_cache_dtype: str) -> str:
    """The page layout of vLLM's real KV cache tensor `kv` (one layer), as `page_layout` names it:
    on a CPU engine with the attention kernel vLLM chose for it (through Symphony's AMX steering,
    which this process has loaded as a vLLM plugin)."""
    dtype = str(kv.dtype).removeprefix("torch.")
    try:
        actual = KVGeometry(geometry.num_layers, geometry.kv_heads, geometry.head_size, geometry.block_size, dtype)
    except ValueError:
        return f"{kv.device.type}/?/{dtype}"  # a dtype the store cannot hold: matches no declared layout
    if kv.device.type != "cpu":
        return page_layout(actual, kv.device.type, "vllm")
    from vllm.v1.attention.backends import cpu_attn

    isa = cpu_attn._get_attn_isa(kv.dtype, geometry.block_size, geometry.head_size, kv_cache_dtype)
    return page_layout(actual, "cpu", isa)


class WorkerSide:
    def __init__(
        self,
        socket_path: str,
        layer_wait_s: float,
        model: ModelFingerprint,
        declared_layout: str,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`model` and `declared_layout`: what the node manager launched this engine for (its model
        fingerprint covers that layout); `register` refuses a cache or a node manager that differs."""
        self._socket_path = socket_path
        self._layer_wait_s = layer_wait_s
        self._model = model
        self._declared_layout = declared_layout
        self._kv_cache_dtype = kv_cache_dtype
        # Reservations belong to the connection that made them: reserves (forward thread) and
        # commits (commit thread) share this one, one call at a time.
        self._control = NodeKVClient(socket_path)
        self._control_lock = threading.Lock()
        self._layers: list[torch.Tensor] = []  # per layer: [num_blocks, page_words] int64 view of vLLM's cache
        self._cuda: torch.device | None = None  # the cache's device, when it is a CUDA one
        self._arena: DramArena | None = None
        self._load: _StepLoad | None = None
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()
        self._reservations: dict[int, tuple[int, np.ndarray, SaveSpec]] | None = None
        self._layer_waits: list[float] = []  # this step's waits (forward thread only)
        self._tails_done: set[str] = set()  # requests whose tail save was tried, not yet reported
        self._finished_ids: dict[str, None] = {}  # insertion-ordered, bounded (MAX_KEPT_FINISHED_IDS)
        # Commits and metric reports, in order, for the control thread.
        self._commits: queue.Queue[_Commit | dict[str, Any] | None] = queue.Queue(MAX_PENDING_COMMITS)
        self._load_stream: torch.cuda.Stream | None = None  # CUDA caches: the loads' own stream
        self._loads: queue.Queue[tuple[list[LoadSpec], _StepLoad] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._commit_loop, name="symphony-kv-commit", daemon=True),
            threading.Thread(target=self._load_loop, name="symphony-kv-load", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ---- setup ------------------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's cache and the node's DRAM arena. Raises ValueError when they cannot hold the
        same pages: another model at the node manager, or a cache whose dtype, page size or
        attention kernel (as vLLM selects it for this cache) is not the layout the model
        fingerprint was computed for. vLLM then fails to start, saying why, rather than storing
        pages another engine would misread. (The page shape itself is the node manager's; only
        its byte size is compared with vLLM's.)"""
        ordered = sorted(kv_caches.items(), key=lambda item: layer_index(item[0]))
        with self._control_lock:
            hello = self._control.hello()
        check_hello_model(hello, self._model)
        geometry = KVGeometry(
            hello["num_layers"], hello["kv_heads"], hello["head_size"], hello["block_size"], hello["dtype"]
        )
        if len(ordered) != geometry.num_layers:
            raise ValueError(f"vLLM has {len(ordered)} KV layers, the node manager's store {geometry.num_layers}")
        layout = cache_page_layout(ordered[0][1], geometry, self._kv_cache_dtype)
        if layout != self._declared_layout:
            raise ValueError(
                f"vLLM's KV cache is laid out as {layout}, but the model fingerprint was computed for "
                f"{self._declared_layout or 'no layout'}; refusing to store its pages under it"
            )
        layers = []
        for name, kv in ordered:
            page_bytes = kv[0].numel() * kv.element_size()
            if page_bytes != geometry.page_bytes or not kv.is_contiguous():
                raise ValueError(
                    f"{name}: vLLM pages of {page_bytes} bytes (contiguous: {kv.is_contiguous()}) do "
                    f"not match the store's {geometry.page_bytes}-byte pages"
                )
            layers.append(kv.view(kv.shape[0], -1).view(torch.int64))  # a page is an opaque row of words
        self._layers = layers
        if layers[0].device.type == "cuda":
            self._cuda = layers[0].device
            self._load_stream = torch.cuda.Stream(self._cuda)
        self._arena = DramArena.attach(
            hello["arena"], geometry, hello["arena_bytes"], writable=True, pin_for_cuda=self._cuda is not None
        )
        log.info(
            "Symphony KV connector attached", layers=len(layers), arena=hello["arena"], page_bytes=geometry.page_bytes
        )

    # ---- loads ------------------------------------------------------------------------------------

    def start_loads(self, loads: Sequence[LoadSpec]) -> None:
        if self._arena is not None:
            self._load_tails([spec for spec in loads if spec.tail_tokens], self._arena)
        loads = [spec for spec in loads if not spec.tail_tokens]
        if not loads or self._arena is None:
            self._load = None
            return
        step = _StepLoad(
            len(self._layers), np.array([b for spec in loads for b in spec.block_ids], np.int64), self._mark_queued()
        )
        self._load = step
        self._loads.put((list(loads), step))

    def wait_layer(self, layer_name: str) -> None:
        step = self._load
        if step is None:
            return
        layer = layer_index(layer_name)
        started = time.perf_counter()
        ready = step.ready[layer].wait(self._layer_wait_s)
        self._layer_waits.append(time.perf_counter() - started)
        if not ready:
            # The forward cannot wait longer: every block of the step is reported, so vLLM drops
            # this step's output for those requests and recomputes them instead of using the cache.
            log.warning("KV layer load timed out; the step's loaded blocks are recomputed", layer=layer)
            with step.lock:  # waits out a layer being copied; none is copied after
                step.abandoned = True
            if self._load_stream is not None:
                # The recompute's writes come after every copy already queued into those blocks.
                torch.cuda.current_stream(self._load_stream.device).wait_stream(self._load_stream)
            self._fail(step.block_ids)
            for event in step.ready:
                event.set()
            return
        landed = step.landed[layer]
        if landed is not None:
            torch.cuda.current_stream(landed.device).wait_event(landed)  # on the GPU: the thread goes on

    def _load_loop(self) -> None:
        single_threaded_torch()  # the forward owns the OpenMP team; this thread copies on its own
        _off_the_forwards_cores()
        client = NodeKVClient(self._socket_path)
        on_stream = False
        while (job := self._loads.get()) is not None:
            loads, step = job
            if self._load_stream is not None and not on_stream:
                # This thread's device and current stream, once: with neither set, CUDA would make
                # a context on device 0 for it (a tensor-parallel rank's cache is on another).
                torch.cuda.set_device(self._load_stream.device)
                torch.cuda.set_stream(self._load_stream)
                on_stream = True
            self._run_load(client, loads, step)

    def _run_load(self, client: NodeKVClient, loads: list[LoadSpec], step: _StepLoad) -> None:
        """One step's load, layer by layer as the node manager answers. The answer is always read to
        its end (the channel's contract), also once the forward has given up on it."""
        load_id = None
        delivered = 0
        try:
            load_id, layers = client.load([_load_item(spec) for spec in loads], timeout_s=self._layer_wait_s)
            if self._load_stream is not None and step.queued is not None:
                self._load_stream.wait_event(step.queued)  # blocks the forward was still using
            for layer, slots in layers:
                assert self._arena is not None
                with step.lock:
                    if step.abandoned:
                        continue
                    self._copy_in(layer, step.block_ids, slots, self._arena)  # failures reported first
                    step.landed[layer] = _recorded(self._load_stream)
                step.ready[layer].set()
                delivered += 1
        except (OSError, KVChannelError) as exc:
            log.warning("KV load failed; its blocks are recomputed", error=str(exc))
        except Exception:
            log.exception("KV load failed; its blocks are recomputed")
        finally:
            try:
                # Before any layer is released to the forward unloaded, and before the pins go back:
                # every copy queued so far has landed (the copies read the pinned slots).
                _landed(self._load_stream if load_id is not None else None)
            finally:
                if delivered < len(step.ready) and not step.abandoned:  # an abandoned step was reported
                    self._fail(step.block_ids)
                for event in step.ready:
                    event.set()
                if load_id is not None:
                    # A broken connection needs no release: the node manager dropped its pins with it.
                    with contextlib.suppress(OSError):
                        client.release(load_id)

    def _load_tails(self, tails: Sequence[LoadSpec], arena: DramArena) -> None:
        """Copy partial blocks (every layer) before the forward starts. vLLM writes a step's new KV
        into the cache before the forward waits for that layer's load, and a partial block's new
        tokens go into the block being loaded: a page copied layer by layer beside the forward
        would overwrite them. One page per request, so waiting costs little."""
        if not tails:
            return
        blocks = np.array([spec.block_ids[0] for spec in tails], np.int64)
        delivered = 0
        try:
            with self._control_lock:
                load_id, layers = self._control.load([_load_item(spec) for spec in tails], timeout_s=self._layer_wait_s)
                try:
                    for layer, slots in layers:
                        self._copy_in(layer, blocks, slots, arena)
                        delivered += 1
                finally:
                    try:
                        _landed(self._cuda_stream())  # before the release: the arena slots may be reused
                    finally:
                        with contextlib.suppress(OSError):
                            self._control.release(load_id)
        except (OSError, KVChannelError) as exc:
            log.warning("KV tail load failed; those blocks are recomputed", error=str(exc))
        if delivered < len(self._layers):
            self._fail(blocks)

    def _copy_in(self, layer: int, block_ids: np.ndarray, slots: np.ndarray, arena: DramArena) -> None:
        """One layer of a load into vLLM's blocks; the blocks whose page the node manager could not
        give (slot -1) are reported as load errors."""
        ok = slots >= 0
        if not ok.all():
            self._fail(block_ids[~ok])
        if ok.any():
            copy_rows(self._layers[layer], block_ids[ok], arena.pages, slots[ok])

    def _fail(self, block_ids: np.ndarray) -> None:
        with self._errors_lock:
            self._load_errors.update(block_ids.tolist())

    def take_load_errors(self) -> set[int]:
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        if errors:
            self._send_report({"load_error_blocks": len(errors)})
        return errors

    def _send_report(self, report: dict[str, Any]) -> None:
        # Metrics never hold up the forward: a report that finds the queue full is dropped.
        with contextlib.suppress(queue.Full):
            self._commits.put_nowait(report)

    # ---- saves ------------------------------------------------------------------------------------

    def save_layer(self, saves: Sequence[SaveSpec], layer_name: str, kv_layer: torch.Tensor) -> None:
        if not saves or self._arena is None:
            return
        if self._reservations is None:
            self._reservations = self._reserve(saves)
        layer = layer_index(layer_name)
        pages = kv_layer.view(kv_layer.shape[0], -1).view(torch.int64)
        for _, slots, spec in self._reservations.values():
            ok = slots[layer] >= 0
            if ok.any():
                copy_rows(self._arena.pages, slots[layer][ok], pages, np.asarray(spec.block_ids, np.int64)[ok])

    def _reserve(self, saves: Sequence[SaveSpec]) -> dict[int, tuple[int, np.ndarray, SaveSpec]]:
        reserved = {}
        for index, spec in enumerate(saves):
            try:
                with self._control_lock:
                    reservation, slots = self._control.reserve(
                        spec.tenant, spec.session, spec.first_block, len(spec.block_ids), spec.token_ids
                    )
            except (OSError, KVChannelError) as exc:
                log.warning("KV save skipped: no slots from the node manager", error=str(exc))
                continue
            reserved[index] = (reservation, slots, spec)
        return reserved

    def save_tails(self, tails: Sequence[TailSave]) -> None:
        """Copy finished requests' partial last blocks (every layer) into reserved DRAM slots and
        queue their commits. A tail that cannot be saved is given up (the next turn recomputes it)
        but reported all the same, so vLLM frees its blocks."""
        for tail in tails:
            if self._arena is not None:
                spec = tail.save
                reserved = self._reserve([spec])
                for reservation, slots, _ in reserved.values():
                    block = np.array(spec.block_ids, np.int64)
                    for layer, pages in enumerate(self._layers):
                        ok = slots[layer] >= 0
                        if ok.any():
                            copy_rows(self._arena.pages, slots[layer][ok], pages, block[ok])
                    self._commits.put(_Commit(reservation, self._mark_queued()))
            self._tails_done.add(tail.request_id)

    def saved_tails(self, finished_req_ids: set[str]) -> set[str] | None:
        """The finished requests whose tail saves are done, among those vLLM has named finished."""
        for request_id in finished_req_ids:
            self._finished_ids[request_id] = None
        while len(self._finished_ids) > MAX_KEPT_FINISHED_IDS:
            del self._finished_ids[next(iter(self._finished_ids))]
        done = {request_id for request_id in self._tails_done if request_id in self._finished_ids}
        for request_id in done:
            self._tails_done.discard(request_id)
            del self._finished_ids[request_id]
        return done or None

    def finish_saves(self) -> None:
        """After the forward: every reserved page's copy is queued; commit them off this thread
        (on CUDA, once the copies are done)."""
        reservations, self._reservations = self._reservations, None
        copied = self._mark_queued() if reservations else None
        for reservation, _, _ in (reservations or {}).values():
            # bounded: if commits fall this far behind, the forward waits
            self._commits.put(_Commit(reservation, copied))
        if self._layer_waits:
            waits, self._layer_waits = self._layer_waits, []
            self._send_report({"layer_waits_s": waits})

    def _commit_loop(self) -> None:
        _off_the_forwards_cores()
        on_device = False
        while (job := self._commits.get()) is not None:
            try:
                if isinstance(job, _Commit) and job.copied is not None:
                    if not on_device:  # see _load_loop: no context on device 0 for this thread
                        torch.cuda.set_device(job.copied.device)
                        on_device = True
                    job.copied.synchronize()  # the node manager reads the arena at commit
                with self._control_lock:
                    if isinstance(job, dict):
                        self._control.report(**job)
                    else:
                        self._control.commit(job.reservation)
            except (OSError, KVChannelError) as exc:
                if not isinstance(job, dict):
                    log.warning("KV save commit failed; those pages stay unsaved", error=str(exc))

    # ---- CUDA streams -------------------------------------------------------------------------------

    def _cuda_stream(self) -> torch.cuda.Stream | None:
        """The calling thread's current stream on the cache's device; None unless it is CUDA."""
        return None if self._cuda is None else torch.cuda.current_stream(self._cuda)

    def _mark_queued(self) -> torch.cuda.Event | None:
        """An event after the work queued so far on the calling thread's stream, for a thread to
        wait on (it sleeps rather than spins)."""
        return _recorded(self._cuda_stream(), blocking=True)

    def close(self) -> None:
        """Stop both threads (their queued work done, or `CLOSE_JOIN_S` each), then unmap the arena
        once no copy can still read or write it."""
        self._commits.put(None)
        self._loads.put(None)
        for thread in self._threads:
            thread.join(CLOSE_JOIN_S)
        self._control.close()
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
        if self._arena is not None:
            self._arena.close()


def _load_item(spec: LoadSpec) -> dict[str, Any]:
    """A load as the node-local channel's `load` operation names it."""
    item: dict[str, Any] = {
        "tenant": spec.tenant,
        "session": spec.session,
        "first_block": spec.first_block,
        "count": len(spec.block_ids),
        "key": spec.last_key.hex(),
    }
    if spec.tail_tokens:
        item["tail_tokens"] = spec.tail_tokens
    return item


def _recorded(stream: torch.cuda.Stream | None, blocking: bool = False) -> torch.cuda.Event | None:
    """An event after the work queued so far on `stream` (None for None: a CPU copy is done when it
    returns)."""
    if stream is None:
        return None
    event = torch.cuda.Event(blocking=blocking)
    event.record(stream)
    return event


def _landed(stream: torch.cuda.Stream | None) -> None:
    """Return once the copies queued on `stream` so far are done (at once for None: CPU)."""
    if stream is not None:
        stream.synchronize()


def _off_the_forwards_cores() -> None:
    """Let this thread run on any of the host's cores. vLLM's CPU worker pins its process to the
    cores of its OpenMP team (one core per engine on a small host), and threads started inside it
    inherit that: a layer's copy would then wait for the forward it is meant to run beside. Linux
    applies sched_setaffinity(0) to the calling thread only; the forward's threads keep their pins."""
    # Not Linux, or a cpuset that allows none of them: the thread keeps the cores it inherited.
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
