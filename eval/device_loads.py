"""`bench tiers --device cuda`: KV held in DRAM loaded into device memory, by the two paths that do it.

- `dram_to_device_gbps`: the store's own layer-wise load (`Loads.into_rows`), what promotions into
  the node's HBM tier run;
- `connector_load_gbps`: the engine's path, the connector's worker side (`WorkerSide`) copying each
  layer from the DRAM arena into a vLLM-shaped cache on its own CUDA stream, timed from
  `start_loads` until the forward's stream has waited for the last layer, into the cache's blocks
  in order; `connector_load_scattered_gbps` the same into them in reverse order (vLLM hands out
  blocks from a free queue, so after a while a request's blocks are scattered). The node manager's
  channel runs in a process of its own, with a store of its own holding the session, as on a node
  (served from the bench's process, its thread shared the loader's GIL: 6.3 GB/s against 8.4).

Each load is preceded by a pinned host-to-device copy of the same bytes
(`host_to_device_bound_gbps`: the median of all of them).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import multiprocessing.synchronize
import queue
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from node_manager.connector.plan import LoadSpec
from node_manager.connector.worker import WorkerSide
from node_manager.kv.ipc_server import LocalKVServer
from node_manager.kv.loader import RowTarget
from node_manager.kv.pages import Tier
from node_manager.kv.store import TieredStore
from node_manager.kv.store_config import StoreConfig
from symphony.kv_addressing import ModelFingerprint
from symphony.kv_geometry import KVGeometry, page_layout

PAIRS = 5  # (bound, path) pairs per trial and path
CHANNEL_START_S = 60.0  # for the channel's process to hold the session and listen, and to stop


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure_host_to_device(pinned: torch.Tensor, on_device: torch.Tensor) -> float:
    """One copy of `pinned` (host memory) into `on_device`."""
    torch.cuda.synchronize(on_device.device)
    started = time.perf_counter()
    on_device.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize(on_device.device)
    return _gbps(pinned.numel() * 8, time.perf_counter() - started)


@dataclass(frozen=True)
class HeldSession:
    """The session the loads bring in: its tokens, and its pages per layer ([blocks, page_words])."""

    tenant: str
    session: str
    token_ids: list[int]
    pages: list[torch.Tensor]


def measure_device_loads(store: TieredStore, held: HeldSession, device: str, work: Path) -> dict[str, float]:
    """`held` must be wholly in `store`'s DRAM; the connector's loads come from a node manager's
    store of their own, in another process, with its files under `work`."""
    tenant, session, pages = held.tenant, held.session, held.pages
    blocks, words = pages[0].shape
    nbytes = pages[0].numel() * 8 * len(pages)
    pinned = torch.cat(pages).pin_memory()
    on_device = torch.empty_like(pinned, device=device)
    bounds: list[float] = []

    def bound() -> None:
        bounds.append(measure_host_to_device(pinned, on_device))

    # The store's load into device rows.
    rows = list(range(blocks))
    dest = [torch.empty(blocks, words, dtype=torch.int64, device=device) for _ in pages]
    store.loads.into_rows(tenant, session, target=RowTarget(dest, rows)).wait_all(60)  # CUDA's lazy init
    store_loads = []
    for _ in range(PAIRS):
        bound()
        started = time.perf_counter()
        results = store.loads.into_rows(tenant, session, target=RowTarget(dest, rows)).wait_all(60)
        store_loads.append(_gbps(nbytes, time.perf_counter() - started))
        assert all(r.by_tier.get(Tier.DRAM) == blocks for r in results), "the device load was not served from DRAM"
    assert all(torch.equal(d.cpu(), p) for d, p in zip(dest, pages, strict=True)), "store load: wrong bytes"
    del dest

    # The connector's load into an engine's cache, as vLLM lays it out (bfloat16 pages), from a node
    # manager's channel in another process, as in a node (in this one, its thread would share the GIL).
    geometry = store.geometry
    context = multiprocessing.get_context("spawn")
    ready: multiprocessing.Queue[bytes] = context.Queue()
    stop = context.Event()
    socket_path = work / "kv.sock"
    channel = context.Process(
        target=serve_channel,
        args=(geometry, store.model, held, device, work, ready, stop),
        daemon=True,
    )
    channel.start()
    try:
        key = _await_channel(ready, channel)
        worker = WorkerSide(
            str(socket_path), layer_wait_s=60, model=store.model, declared_layout=page_layout(geometry, "cuda", "vllm")
        )
        names = [f"model.layers.{layer}.self_attn.attn" for layer in range(geometry.num_layers)]
        caches = {name: torch.empty(blocks, words * 4, dtype=torch.bfloat16, device=device) for name in names}
        orders = {"connector_load_gbps": rows, "connector_load_scattered_gbps": rows[::-1]}
        connector: dict[str, list[float]] = {name: [] for name in orders}
        try:
            worker.register(caches)
            for name, order in orders.items():
                spec = LoadSpec(tenant, session, 0, tuple(order), key)
                for trial in range(PAIRS + 1):  # the first: CUDA's lazy init of the worker's stream and kernels
                    bound()
                    started = time.perf_counter()
                    worker.start_loads([spec])
                    for layer_name in names:
                        worker.wait_layer(layer_name)
                    torch.cuda.synchronize(device)  # the forward's stream has waited for the last layer
                    elapsed = time.perf_counter() - started
                    worker.finish_saves()  # the step's end: its metric report
                    if trial:
                        connector[name].append(_gbps(nbytes, elapsed))
                assert not worker.take_load_errors(), "the connector failed some blocks"
                loaded = [caches[layer_name].view(torch.int64)[order].cpu() for layer_name in names]
                assert all(torch.equal(c, p) for c, p in zip(loaded, pages, strict=True)), f"{name}: wrong bytes"
        finally:
            worker.close()
    finally:
        stop.set()
        channel.join(CHANNEL_START_S)
        if channel.is_alive():
            channel.kill()
    return {
        "host_to_device_bound_gbps": statistics.median(bounds),
        "dram_to_device_gbps": statistics.median(store_loads),
        **{name: statistics.median(values) for name, values in connector.items()},
    }


def _await_channel(ready: multiprocessing.Queue[bytes], channel: multiprocessing.process.BaseProcess) -> bytes:
    """The key the channel's process sends once it serves; an error if it dies or takes too long."""
    deadline = time.monotonic() + CHANNEL_START_S
    while time.monotonic() < deadline:
        try:
            return ready.get(timeout=0.5)
        except queue.Empty:
            if channel.exitcode is not None:
                raise RuntimeError(f"the channel's process exited ({channel.exitcode}) before serving") from None
    raise RuntimeError(f"the channel's process did not serve within {CHANNEL_START_S:g} s")


def serve_channel(
    geometry: KVGeometry,
    model: ModelFingerprint,
    held: HeldSession,
    device: str,
    work: Path,
    ready: multiprocessing.Queue[bytes],
    stop: multiprocessing.synchronize.Event,
) -> None:
    """The channel's process: a store holding `held` in DRAM, served at `work`/kv.sock; puts the
    session's last block key on `ready`, and serves until `stop` is set."""
    tenant, session, pages = held.tenant, held.session, held.pages
    nbytes = pages[0].numel() * 8 * len(pages)
    store = TieredStore(
        geometry,
        StoreConfig(
            hbm_bytes=0,
            dram_bytes=2 * nbytes,
            ssd_bytes=4 * nbytes,
            ssd_dir=work / "channel-ssd",
            arena_name=f"symphony-bench-channel-{uuid.uuid4().hex[:8]}",
            model=model,
            device=device,
        ),
    )
    try:
        store.sessions.put(tenant, session, held.token_ids)
        for layer, layer_pages in enumerate(pages):
            store.ingest.save_layer(tenant, session, layer, 0, layer_pages).result(60)
        server = LocalKVServer(store, work / "kv.sock")
        try:
            ready.put(bytes(store.sessions.get(tenant, session).blocks.block_keys[-1]))
            stop.wait(3600)
        finally:
            server.close()
    finally:
        store.close()
