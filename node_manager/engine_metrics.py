"""Read the load figures the scheduler routes on from a vLLM engine's Prometheus text."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
# An info gauge (always 1) whose labels are the engine's cache config, `num_gpu_blocks` and
# `block_size` among them: the capacity `KV_USAGE` is a fraction of. Optional: 0 when absent.
CACHE_CONFIG = "vllm:cache_config_info"
_BLOCKS = re.compile(r'[{,]\s*num_gpu_blocks="(\d+)"')
_BLOCK_SIZE = re.compile(r'[{,]\s*block_size="(\d+)"')


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    kv_usage: float
    kv_tokens: int = 0  # tokens the engine's KV cache holds, summed over its engines; 0: not reported


class MetricsFormatError(ValueError):
    pass


def parse_engine_load(text: str) -> EngineLoad:
    """Sum each gauge over its label sets (one per engine/model). Missing gauges are an error: an
    engine without them is not a vLLM v1 engine, and routing on zeros would be silently wrong."""
    sums: dict[str, float] = {}
    kv_tokens = 0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = len(line)
        for sep in ("{", " "):
            idx = line.find(sep)
            if idx != -1:
                name_end = min(name_end, idx)
        name = line[:name_end]
        if name == CACHE_CONFIG:
            kv_tokens += _cache_tokens(line)
            continue
        if name not in (RUNNING, WAITING, KV_USAGE):
            continue
        rest = line[name_end:]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1 :]  # label values may hold spaces; the value follows the last brace
        try:
            value = float(rest.split()[0])  # an optional timestamp may follow the value
        except (IndexError, ValueError):
            raise MetricsFormatError(f"unparseable sample: {line[:200]!r}") from None
        if not math.isfinite(value):
            # Routing on NaN or infinite load would pick nodes arbitrarily; treat it as no reading.
            raise MetricsFormatError(f"non-finite sample: {line[:200]!r}")
        sums[name] = sums.get(name, 0.0) + value
    missing = [n for n in (RUNNING, WAITING, KV_USAGE) if n not in sums]
    if missing:
        raise MetricsFormatError(f"engine metrics lack {', '.join(missing)}")
    return EngineLoad(int(sums[RUNNING]), int(sums[WAITING]), min(max(sums[KV_USAGE], 0.0), 1.0), kv_tokens)


def _cache_tokens(line: str) -> int:
    """One engine's KV capacity in tokens from its `CACHE_CONFIG` sample; 0 when a label is missing
    or not a count (vLLM renders an unset block count as "None")."""
    labels = line[: line.rfind("}") + 1]
    blocks, size = _BLOCKS.search(labels), _BLOCK_SIZE.search(labels)
    return int(blocks.group(1)) * int(size.group(1)) if blocks and size else 0
