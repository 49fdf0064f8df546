"""Request traces replayed at their recorded times: Mooncake's format and Azure's conversation trace.

Mooncake (FAST'25 release): JSON lines of {"timestamp" (ms), "input_length", "output_length",
"hash_ids"}: each hash id names one 512-token block of the prompt, and equal ids mean a shared prefix
block. `mooncake_prompt` turns a request into token ids with exactly that sharing: block `h` is
the same seeded random 512 tokens wherever it appears, and the last block is cut to the input length.

Azure LLM inference trace 2023 (conversation): CSV of TIMESTAMP, ContextTokens, GeneratedTokens;
lengths and arrival times only (no content, no prefix information).

`time_scale` stretches or compresses the arrival times (0.5: twice as fast). Any file in these
formats works; samples of both published traces ship in eval/data.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

MOONCAKE_SAMPLE = Path(__file__).resolve().parent / "data" / "mooncake" / "conversation_trace_sample.jsonl"
AZURE_SAMPLE = Path(__file__).resolve().parent / "data" / "azure" / "AzureLLMInferenceTrace_conv_sample.csv"
MOONCAKE_BLOCK_TOKENS = 512
TOKEN_ID_RANGE = (1_000, 40_000)  # ordinary vocabulary entries of SmolLM2; the engine never sees specials


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake prefix blocks; empty where the trace has none


def sessions_of(requests: list[TraceRequest]) -> list[str]:
    """A session name per request (in arrival order) for a per-session KV model (the simulator).
    A conversation's next turn carries its previous prompt, so a request continues the session of
    an earlier request whose prompt blocks, all of them or all but the last (which may have been
    partial), lead its own and make at least half of it; otherwise it starts a session. Requests
    without hash ids are sessions of their own."""
    ends: dict[int, str] = {}  # prefix chain id of an earlier prompt (whole, or less its last block) -> session
    names = []
    for index, request in enumerate(requests):
        chain, prefixes = 0, []
        for hash_id in request.hash_ids:
            chain = hash((chain, hash_id))
            prefixes.append(chain)
        # The longest match, if it is at least half of this prompt (and two blocks): a next turn adds
        # a message and an answer to its history; a shared system prompt alone is not a history.
        least = max(2, (len(prefixes) + 1) // 2)
        session = next(
            (ends[prefixes[n - 1]] for n in range(len(prefixes), least - 1, -1) if prefixes[n - 1] in ends), f"s{index}"
        )
        names.append(session)
        if prefixes:
            ends[prefixes[-1]] = session
            if len(prefixes) > 1:
                ends[prefixes[-2]] = session
    return names


def _check_scale(time_scale: float) -> None:
    if not time_scale > 0:
        raise ValueError(f"time_scale {time_scale} must be positive")


def load_mooncake(path: Path, *, time_scale: float = 1.0, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests in arrival order; ValueError naming the line that is not one."""
    _check_scale(time_scale)
    requests = []
    with path.open() as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                request = TraceRequest(
                    float(row["timestamp"]) * time_scale,
                    int(row["input_length"]),
                    int(row["output_length"]),
                    tuple(int(h) for h in row["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a Mooncake trace record ({exc})") from None
            if request.input_tokens < 1 or request.output_tokens < 1:
                raise ValueError(f"{path}:{number}: lengths must be positive")
            if len(request.hash_ids) * MOONCAKE_BLOCK_TOKENS < request.input_tokens:
                raise ValueError(
                    f"{path}:{number}: {len(request.hash_ids)} blocks cannot hold {request.input_tokens} tokens"
                )
            requests.append(request)
            if limit is not None and len(requests) >= limit:
                break
    return sorted(requests, key=lambda r: r.arrival_ms)


def mooncake_prompt(request: TraceRequest, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
    """Token ids for the request: block `h` is the same everywhere (seeded by `h`), so two requests
    share exactly the prefix blocks their hash ids share."""
    tokens: list[int] = []
    for hash_id in request.hash_ids:
        rng = random.Random(hash_id)
        tokens.extend(rng.randrange(*TOKEN_ID_RANGE) for _ in range(block_tokens))
        if len(tokens) >= request.input_tokens:
            break
    return tokens[: request.input_tokens]


def load_azure(path: Path, *, time_scale: float = 1.0, limit: int | None = None) -> list[TraceRequest]:
    """Azure's trace: arrivals relative to its first request; ValueError naming a bad row."""
    _check_scale(time_scale)
    requests = []
    start: datetime | None = None
    with path.open(newline="") as handle:
        for number, row in enumerate(csv.DictReader(handle), 2):
            try:
                # Seven fractional digits in the file; datetime takes six.
                stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
                context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path}:{number}: not an Azure trace row ({exc})") from None
            start = start or stamp
            requests.append(
                TraceRequest((stamp - start).total_seconds() * 1000 * time_scale, max(1, context), max(1, generated))
            )
            if limit is not None and len(requests) >= limit:
                break
    return sorted(requests, key=lambda r: r.arrival_ms)
