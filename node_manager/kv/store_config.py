"""`StoreConfig`: the sizes and limits of one node's tiered KV store (`TieredStore`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from symphony.config import STORE_POSITIVE_KEYS, tier_capacities_error
from symphony.kv_addressing import FINGERPRINT_BYTES, ModelFingerprint


@dataclass(frozen=True)
class StoreConfig:
    hbm_bytes: int
    dram_bytes: int
    ssd_bytes: int
    ssd_dir: Path
    arena_name: str
    model: ModelFingerprint  # whose KV the store holds: keys hang off it, segments carry it
    device: str = "cpu"
    io_threads: int = 2
    max_inflight_jobs: int = 256  # queued + running layer jobs and save copies
    segment_max_bytes: int = 8 * 1024 * 1024
    ssd_writers: int = 2
    max_sessions: int = 100_000
    max_session_tokens: int = 1_048_576
    # How long the write-behind may hold off while a foreground transfer (a peer pull) runs.
    write_behind_max_delay_s: float = 0.5
    ssd_keep_other_models: bool = False  # keep other models' segments on disk, unloaded (`SsdTier`)
    ssd_headroom_bytes: int = 0  # left free on the SSD tier's filesystem (`SsdTier`)
    # The cluster's secret, which keys every page's MAC (`pages.PageMac`); empty: an unkeyed check.
    page_secret: bytes = field(default=b"", repr=False)

    def validate(self) -> None:
        capacities = tier_capacities_error(self.hbm_bytes, self.dram_bytes, self.ssd_bytes)
        if capacities is not None:
            raise ValueError(f"KV tier capacities must satisfy {capacities}")
        for name in STORE_POSITIVE_KEYS:
            if getattr(self, name) <= 0:
                raise ValueError(f"KV store: {name} must be positive")
        if self.write_behind_max_delay_s < 0:
            raise ValueError("KV store: write_behind_max_delay_s must be >= 0")
        if len(self.model) != FINGERPRINT_BYTES:
            raise ValueError(f"KV store: a model fingerprint is {FINGERPRINT_BYTES} bytes, got {len(self.model)}")
