"""The shape of one KV page: (block, layer) in the engine's own layout, copied as opaque bytes.

vLLM CPU keeps each layer as `[num_blocks, kv_heads, block_size, 2 * head_size]`, so one block of one
layer is a contiguous run of kv_heads * block_size * 2 * head_size elements: K rows then V rows per
head. Symphony never interprets the bytes; it only needs their size, which this class computes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Pages are handled as rows of 8-byte words (fast gather/scatter copies); every real geometry is a
# multiple of 8 bytes, and this keeps a bad one from producing torn rows.
PAGE_WORD_BYTES = 8


@dataclass(frozen=True, slots=True)
class KVGeometry:
    num_layers: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KV geometry: {name} must be positive, got {getattr(self, name)}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"KV geometry: dtype {self.dtype!r} is not one of {', '.join(_DTYPE_BYTES)}")
        if self.page_bytes % PAGE_WORD_BYTES:
            raise ValueError(f"KV geometry: page of {self.page_bytes} bytes is not a multiple of {PAGE_WORD_BYTES}")

    @property
    def page_bytes(self) -> int:
        """Bytes of one (block, layer) page."""
        return self.kv_heads * self.block_size * 2 * self.head_size * _DTYPE_BYTES[self.dtype]

    @property
    def page_words(self) -> int:
        return self.page_bytes // PAGE_WORD_BYTES

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.page_bytes * self.num_layers

    def bytes_per_token(self) -> float:
        return self.block_bytes / self.block_size


def smollm2_geometry(block_size: int = 32) -> KVGeometry:
    """SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, bf16 (≈ 23 KB of KV per token)."""
    return KVGeometry(num_layers=30, kv_heads=3, head_size=64, block_size=block_size, dtype="bfloat16")


def hf_config_for(geometry: KVGeometry) -> dict[str, object]:
    """The config.json fields `geometry_from_model_dir` reads, for a KV-only node that serves no model."""
    heads = geometry.kv_heads * 3  # any multiple of kv_heads: only the KV shape matters here
    return {
        "num_hidden_layers": geometry.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": geometry.kv_heads,
        "hidden_size": heads * geometry.head_size,
        "head_dim": geometry.head_size,
        "torch_dtype": geometry.dtype,
    }


def geometry_from_model_dir(model_dir: Path, block_size: int, dtype: str) -> KVGeometry:
    """Read the KV shape from a Hugging Face config.json (Llama-style field names)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_size = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the KV geometry from {model_dir}/config.json: {exc}") from None
    if dtype == "auto":
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return KVGeometry(layers, kv_heads, head_size, block_size, dtype)


def cpu_attention_isa(
    dtype: str, block_size: int, head_size: int, *, amx_allowed: bool, amx_supported: bool, machine: str
) -> str:
    """The kernel vLLM 0.32's CPU attention packs pages for (`cpu_attn._get_attn_isa`, with Symphony's
    AMX steering, `node_manager.vllm_plugin`): the packing differs between kernels, so it is part of
    the page layout. The connector checks this against vLLM's own choice when it attaches, so a vLLM
    that decides otherwise fails loudly instead of storing pages under the wrong layout. Architectures
    this does not know get their machine name (the connector's check then refuses them)."""
    if head_size % 32 != 0 and head_size % 16 == 0:
        return "vec16"
    machine = machine.lower()
    if amx_allowed and amx_supported and dtype == "bfloat16" and block_size % 32 == 0:
        return "amx"
    if machine in ("aarch64", "arm64"):
        return "neon"
    if block_size % 32 != 0:
        return "vec16"
    if machine in ("x86_64", "amd64"):
        return "vec"
    return {"s390x": "vxe", "ppc64le": "vsx", "ppc64": "vsx"}.get(machine, machine)


def page_layout(geometry: KVGeometry, platform: str, attention: str) -> str:
    """How a block's pages are laid out: engine platform, attention kernel, layers x page shape, and
    dtype. Part of the model fingerprint: the same tokens under another layout are other bytes."""
    return (
        f"{platform}/{attention}/{geometry.num_layers}x[block,{geometry.kv_heads},{geometry.block_size},"
        f"{2 * geometry.head_size}]/{geometry.dtype}"
    )
