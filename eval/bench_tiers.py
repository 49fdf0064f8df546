"""`symphony bench tiers`: throughput of each KV tier against the bound the hardware sets for it.

One session of SmolLM2 geometry (30 layers, 3 KV heads, head dim 64, bf16, 32-token blocks) and
2,048 tokens (≈ 47 MB). Every trial measures each path once, interleaved, and the keys are medians
over trials, so a noisy neighbour slows a bound and its path alike and the ratios stay meaningful.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import torch
from tqdm import tqdm

from eval.child_process import stop_child
from eval.device_loads import HeldSession, measure_device_loads
from eval.plots import plot_tiers
from eval.ports import free_port
from eval.results import write_result
from node_manager.kv.loader import RowTarget
from node_manager.kv.pages import PageMac, Tier
from node_manager.kv.puller import PeerPuller
from node_manager.kv.store import TieredStore
from node_manager.kv.store_config import StoreConfig
from node_manager.kv.transfer import page_batch
from symphony.config_secrets import new_cluster_secret
from symphony.kv_addressing import ModelFingerprint, chain_block_keys
from symphony.kv_geometry import KVGeometry, hf_config_for, smollm2_geometry
from symphony.rpc import kv_pb2, kv_pb2_grpc

TARGETS = {  # key: (numerator, denominator, minimum ratio) or a maximum ratio for latencies
    "dram_load_vs_memcpy": ("dram_load_gbps", "memcpy_gbps", 0.7),
    "ssd_read_vs_disk": ("ssd_read_gbps", "disk_read_bound_gbps", 0.6),
    "ssd_write_vs_disk": ("ssd_write_gbps", "disk_write_bound_gbps", 0.6),
    "peer_fetch_vs_loopback": ("peer_fetch_gbps", "loopback_bound_gbps", 0.5),
}
# With a device (--device cuda): the engine's load (the connector's) against a pinned host-to-device
# copy of the same bytes; the store's own load into device rows is reported beside it (eval/device_loads.py).
DEVICE_TARGETS = {"connector_load_vs_bound": ("connector_load_gbps", "host_to_device_bound_gbps", 0.7)}
FIRST_LAYER_MAX_FRACTION = 0.1
MEMORY_PAIRS = 5  # (memcpy bound, DRAM load) pairs per trial, medians kept
PEER_PAIRS = 3  # (loopback bound, peer pull) pairs per trial, medians kept
TENANT = "bench"
# The local stores' model: any fixed fingerprint (a pull's store takes its peer's, which it must match).
BENCH_MODEL = ModelFingerprint(hashlib.sha256(b"symphony-bench-tiers").digest())
# Every store and peer of a run shares a cluster secret, as a cluster's nodes do: pages carry MACs
# under it (`PageMac`), which cost what they cost whatever the key.
BENCH_SECRET = new_cluster_secret()


@contextlib.contextmanager
def _single_threaded_torch() -> Iterator[None]:
    """The bench's own tensor work (zeroing destinations, checking bytes) on this thread only. Run
    on torch's OpenMP team, it leaves that team spinning for a while after each op, holding a core
    while the next measurement starts (docs/benchmarks.md#bench-tiers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _same_bytes(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    with _single_threaded_torch():
        return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def session_pages(geometry: KVGeometry, blocks: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(-(2**62), 2**62, (blocks, geometry.page_words), dtype=torch.int64, generator=gen)
        for _ in range(geometry.num_layers)
    ]


def _store(
    geometry: KVGeometry,
    ssd_dir: Path,
    name: str,
    session_bytes: int,
    device: str,
    model: ModelFingerprint = BENCH_MODEL,
) -> TieredStore:
    with _single_threaded_torch():  # the HBM pool is zeroed just before a measurement starts
        return TieredStore(
            geometry,
            StoreConfig(
                hbm_bytes=2 * session_bytes,
                dram_bytes=4 * session_bytes,
                ssd_bytes=64 * session_bytes,
                ssd_dir=ssd_dir,
                arena_name=f"symphony-bench-{os.getpid()}-{name}",
                model=model,
                device=device,
                page_secret=BENCH_SECRET.encode(),
            ),
        )


def measure_memcpy(pages: list[torch.Tensor], threads: int) -> float:
    """One copy of the session's bytes by `threads` threads: the store's copy lanes are as many."""
    src = torch.cat(pages)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first: the store's arena is warm too
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.perf_counter()
        dst.copy_(src)
        return _gbps(src.numel() * 8, time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)


def measure_disk_bounds(directory: Path, nbytes: int) -> tuple[float, float]:
    """Plain sequential write + fsync, then an uncached sequential read, of the same bytes."""
    data = os.urandom(nbytes)
    path = directory / "bound.bin"
    os.sync()  # see measure_store_paths: no earlier writeback lands inside this measurement
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    write = _gbps(nbytes, time.perf_counter() - started)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    started = time.perf_counter()
    offset = 0
    while offset < nbytes:
        offset += os.preadv(fd, [view[offset : offset + (4 << 20)]], offset)
    read = _gbps(nbytes, time.perf_counter() - started)
    os.close(fd)
    path.unlink()
    return write, read


def measure_loopback(nbytes: int) -> float:
    """Raw TCP over loopback: one sender thread, the receiver here; 4 MiB sends and receives."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = memoryview(os.urandom(4 << 20))

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sent = 0
            while sent < nbytes:
                chunk = payload[: min(len(payload), nbytes - sent)]
                sock.sendall(chunk)
                sent += len(chunk)

    sender = threading.Thread(target=send)
    sender.start()
    conn, _ = server.accept()
    buffer = bytearray(4 << 20)
    started = time.perf_counter()
    received = 0
    while received < nbytes:
        got = conn.recv_into(buffer)
        if not got:
            break
        received += got
    elapsed = time.perf_counter() - started
    sender.join()
    conn.close()
    server.close()
    return _gbps(received, elapsed)


def measure_store_paths(
    geometry: KVGeometry, pages: list[torch.Tensor], token_ids: list[int], work: Path, trial: int, device: str
) -> dict[str, float]:
    blocks = pages[0].shape[0]
    nbytes = blocks * geometry.block_bytes
    ssd_dir = work / f"ssd-{trial}"
    out: dict[str, float] = {}
    store = _store(geometry, ssd_dir, f"a{trial}", nbytes, device)
    try:
        store.sessions.put(TENANT, "s", token_ids)
        # The write bound just before left an unlinked file and journal work behind; without a sync
        # the device is still busy with them when the save starts (docs/benchmarks.md#bench-tiers).
        os.sync()
        started = time.perf_counter()
        futures = [store.ingest.save_layer(TENANT, "s", layer, 0, pages[layer]) for layer in range(geometry.num_layers)]
        kept = sum(f.result(60) for f in futures)
        out["dram_store_gbps"] = _gbps(nbytes, time.perf_counter() - started)
        if not store.write_behind.flush(120):
            raise RuntimeError("write-behind did not drain")
        out["ssd_write_gbps"] = _gbps(nbytes, time.perf_counter() - started)
        assert kept == blocks * geometry.num_layers, f"only {kept} pages kept"
        dest = [torch.empty(blocks, geometry.page_words, dtype=torch.int64) for _ in range(geometry.num_layers)]
        rows = list(range(blocks))
        store.loads.into_rows(TENANT, "s", target=RowTarget(dest, rows)).wait_all(60)  # warm the destination
        # Each load is paired with a bound taken right before it (a shared host's memory bandwidth
        # moves with its neighbours' load from one moment to the next), several pairs per trial: one
        # copy is shorter than a scheduler hiccup (docs/benchmarks.md#bench-tiers).
        bounds, loads = [], []
        for _ in range(MEMORY_PAIRS):
            bounds.append(measure_memcpy(pages, store.config.io_threads))
            started = time.perf_counter()
            results = store.loads.into_rows(TENANT, "s", target=RowTarget(dest, rows)).wait_all(60)
            loads.append(_gbps(nbytes, time.perf_counter() - started))
            assert all(not r.failed for r in results)
        assert _same_bytes(dest, pages), "DRAM load returned wrong bytes"
        out["memcpy_gbps"], out["dram_load_gbps"] = statistics.median(bounds), statistics.median(loads)
        if device != "cpu":
            channel_work = work / f"channel-{trial}"
            channel_work.mkdir()
            out.update(measure_device_loads(store, HeldSession(TENANT, "s", token_ids, pages), device, channel_work))
    finally:
        store.close()
    # A fresh store on the same directory: DRAM is empty, so every page comes from SSD (uncached).
    store = _store(geometry, ssd_dir, f"b{trial}", nbytes, device)
    try:
        store.sessions.put(TENANT, "s", token_ids)
        store.ssd.drop_cache()
        with _single_threaded_torch():
            dest = [torch.zeros(blocks, geometry.page_words, dtype=torch.int64) for _ in range(geometry.num_layers)]
        started = time.perf_counter()
        handle = store.loads.into_rows(TENANT, "s", target=RowTarget(dest, list(range(blocks))))
        handle.layer_ready(0).result(60)
        first = time.perf_counter() - started
        results = handle.wait_all(60)
        elapsed = time.perf_counter() - started
        assert all(r.by_tier.get(Tier.SSD) == blocks for r in results), "SSD load was served from elsewhere"
        assert _same_bytes(dest, pages), "SSD load returned wrong bytes"
        out["ssd_read_gbps"] = _gbps(nbytes, elapsed)
        out["ssd_first_layer_ready_ms"] = first * 1000
        out["ssd_all_layers_ready_ms"] = elapsed * 1000
    finally:
        store.close()
        shutil.rmtree(ssd_dir, ignore_errors=True)
    return out


class PeerNode:
    """A real `symphony node` process (engine disabled) holding the session the bench pulls."""

    def __init__(self, work: Path, geometry: KVGeometry) -> None:
        model = work / "geometry-model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(hf_config_for(geometry)))
        (model / "model.safetensors").write_bytes(b"")
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        config = work / "peer.toml"
        config.write_text(
            f'home = "{work}"\n[node]\ngrpc_port_base = {port}\n[engine]\nenabled = false\n'
            f'model = "{model}"\nblock_size = {geometry.block_size}\n[kv]\nmetrics_port_base = 0\n'
            f"hbm_bytes = {256 << 20}\ndram_bytes = {512 << 20}\nssd_bytes = {4 << 30}\n"
            f'[cluster]\nsecret = "{BENCH_SECRET}"\n'
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")}
        self.log = (work / "peer.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "node", "--config", str(config), "--index", "0"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    async def wait_ready(self, stub: kv_pb2_grpc.KVStoreStub, within_s: float = 60) -> None:
        deadline = time.monotonic() + within_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"peer node exited ({self.process.returncode}); see {self.log.name}")
            try:
                await stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=1)
                return
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise RuntimeError("peer node did not start") from None
                await asyncio.sleep(0.2)  # polling a child process that is starting up

    def stop(self) -> None:
        stop_child(self.process, self.log)


async def _timed_pull(geometry: KVGeometry, peer: str, directory: Path, nbytes: int, model: ModelFingerprint) -> float:
    """GB/s of one pull of the session from `peer` (serving `model`) into a fresh store."""
    store = _store(geometry, directory, directory.name, nbytes, "cpu", model)
    puller = PeerPuller(store, timeout_s=60)
    try:
        await puller.connect(peer)  # a node's channels to its peers are long-lived
        started = time.perf_counter()
        reply = await puller.pull(TENANT, "s", peer)
        elapsed = time.perf_counter() - started
        if not reply.complete:
            raise RuntimeError(f"peer pull incomplete: {reply}")
        return _gbps(nbytes, elapsed)
    finally:
        await puller.close()
        await asyncio.to_thread(store.close)
        shutil.rmtree(directory, ignore_errors=True)


async def measure_peer_fetch(
    geometry: KVGeometry, pages: list[torch.Tensor], token_ids: list[int], work: Path, trials: int, progress: tqdm
) -> dict[str, list[float]]:
    """Per trial, PEER_PAIRS times the loopback bound and then a pull of the session from a peer
    node process, in that order, so the two are measured under the same conditions; each key's
    sample for the trial is the median of its pairs: {key: samples}."""
    peer = PeerNode(work, geometry)
    channel = grpc.aio.insecure_channel(peer.address)
    try:
        stub = kv_pb2_grpc.KVStoreStub(channel)
        await peer.wait_ready(stub)
        ref = kv_pb2.SessionRef(tenant=TENANT, session_id="s")
        await stub.PutSession(kv_pb2.PutSessionRequest(session=ref, token_ids=token_ids), timeout=30)
        model = ModelFingerprint((await stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=30)).model_fingerprint)
        keys = chain_block_keys(model, TENANT, token_ids, geometry.block_size).block_keys
        mac = PageMac(BENCH_SECRET.encode())
        batches = [
            page_batch(mac, ref, keys, layer, 0, layer_pages.numpy().tobytes())
            for layer, layer_pages in enumerate(pages)
        ]
        await stub.WritePages(iter(batches), timeout=60)
        nbytes = len(keys) * geometry.block_bytes
        rates: dict[str, list[float]] = {"loopback_bound_gbps": [], "peer_fetch_gbps": []}
        for trial in range(trials):
            # Several pairs per trial, as for DRAM loads: one loopback pass is short, and either side
            # of a single pair can land on a moment a neighbour has the CPU.
            bounds, pulls = [], []
            for pair in range(PEER_PAIRS):
                bounds.append(measure_loopback(nbytes))
                pulls.append(await _timed_pull(geometry, peer.address, work / f"pull-{trial}-{pair}", nbytes, model))
            rates["loopback_bound_gbps"].append(statistics.median(bounds))
            rates["peer_fetch_gbps"].append(statistics.median(pulls))
            progress.update(1)
        return rates
    finally:
        await channel.close()
        peer.stop()


def run_tiers_bench(
    *,
    out: Path,
    tokens: int = 2048,
    trials: int = 9,
    device: str = "cpu",
    work_dir: Path | None = None,
    plot: Path | None = None,
) -> dict[str, Any]:
    geometry = smollm2_geometry()
    blocks = tokens // geometry.block_size
    if blocks < 1:
        raise ValueError("--tokens must cover at least one block")
    nbytes = blocks * geometry.block_bytes
    pages = session_pages(geometry, blocks)
    token_ids = [(i * 7919) % 49152 for i in range(blocks * geometry.block_size)]
    work = Path(tempfile.mkdtemp(prefix="symphony-bench-tiers-", dir=work_dir))
    samples: dict[str, list[float]] = {}
    try:
        with tqdm(total=trials * 2, desc="bench tiers", unit="trial", file=sys.stderr) as progress:
            for trial in range(trials):
                row: dict[str, float] = {}
                row["disk_write_bound_gbps"], row["disk_read_bound_gbps"] = measure_disk_bounds(work, nbytes)
                row.update(measure_store_paths(geometry, pages, token_ids, work, trial, device))
                for key, value in row.items():
                    samples.setdefault(key, []).append(value)
                progress.update(1)
            samples.update(asyncio.run(measure_peer_fetch(geometry, pages, token_ids, work, trials, progress)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {key: statistics.median(values) for key, values in samples.items()}
    result.update(
        {
            "session_tokens": blocks * geometry.block_size,
            "session_bytes": nbytes,
            "trials": trials,
            "device": device,
            "io_threads": StoreConfig.io_threads,
            "page_bytes": geometry.page_bytes,
            "samples": samples,
        }
    )
    targets = {**TARGETS, **(DEVICE_TARGETS if device != "cpu" else {})}
    ratios = {name: result[num] / result[den] for name, (num, den, _) in targets.items()}
    ratios["ssd_first_layer_fraction"] = result["ssd_first_layer_ready_ms"] / result["ssd_all_layers_ready_ms"]
    result["ratios"] = ratios
    result["targets_met"] = {name: ratios[name] >= minimum for name, (_, _, minimum) in targets.items()}
    result["targets_met"]["ssd_first_layer_fraction"] = ratios["ssd_first_layer_fraction"] <= FIRST_LAYER_MAX_FRACTION
    write_result(result, out, table=_print_table, plot=plot, plotter=plot_tiers)
    return result


def _print_table(result: dict[str, Any]) -> None:
    print(
        f"session: {result['session_tokens']} tokens, {result['session_bytes'] / 1e6:.1f} MB, "
        f"median of {result['trials']} trials"
    )
    for key in (
        "memcpy_gbps",
        "dram_store_gbps",
        "dram_load_gbps",
        "disk_write_bound_gbps",
        "ssd_write_gbps",
        "disk_read_bound_gbps",
        "ssd_read_gbps",
        "loopback_bound_gbps",
        "peer_fetch_gbps",
        "host_to_device_bound_gbps",
        "dram_to_device_gbps",
        "connector_load_gbps",
        "connector_load_scattered_gbps",
    ):
        if key in result:
            print(f"  {key:<24}{result[key]:>9.2f} GB/s")
    print(f"  {'ssd_first_layer_ready_ms':<24}{result['ssd_first_layer_ready_ms']:>9.2f} ms")
    print(f"  {'ssd_all_layers_ready_ms':<24}{result['ssd_all_layers_ready_ms']:>9.2f} ms")
    for name, ok in result["targets_met"].items():
        print(f"  target {name}: ratio {result['ratios'][name]:.2f} {'met' if ok else 'NOT met'}")
