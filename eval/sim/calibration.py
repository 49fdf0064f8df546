"""Fitting the simulator's engine model to measurements of a live engine, and preset files.

Pure arithmetic, no I/O but the preset file: `eval.bench_calibrate` takes the measurements.

The engine model (`eval.sim.engine`) prices a step as `step_ms + prefill_ms_per_token x prefilled
tokens + decode_ms_per_seq x decoding requests + decode_ms_per_kilotoken x their context / 1000`,
and every request pays `request_overhead_ms` outside the steps. The measurements that pin these down:

- decode samples: B requests decoding together over a known context, their time per output token
  = one step = `step_ms + decode_ms_per_seq x B + decode_ms_per_kilotoken x context / 1000`, a
  linear least-squares fit over samples of several batch sizes and context lengths;
- prefill samples: one request alone, `max_tokens=1`, with an N-token prompt no cache holds: its
  time to first token = `request_overhead_ms + step_ms + prefill_ms_per_token x N +
  prefill_ms_per_token_kilotoken x N^2 / 2000`, fitted over several N; the intercept less the
  decode fit's `step_ms` is the overhead;
- the same kinds of samples taken beside busy neighbour engines on the same host: how much slower
  they ran than the model fitted alone predicts is the model's `neighbour_slowdown`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eval.sim.cluster import LinkModel
from eval.sim.engine import EngineModel
from eval.sim.presets import Preset


@dataclass(frozen=True, slots=True)
class PrefillSample:
    prompt_tokens: int
    ttft_ms: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    batch: int  # requests decoding together
    context_tokens: int  # their context summed, at the middle of the measured stretch
    tpot_ms: float


@dataclass(frozen=True, slots=True)
class EngineFit:
    model: EngineModel
    prefill_r2: float
    decode_r2: float


def _r2(observed: np.ndarray, predicted: np.ndarray) -> float:
    spread = float(((observed - observed.mean()) ** 2).sum())
    return 1.0 - float(((observed - predicted) ** 2).sum()) / spread if spread else 1.0


def _fit_non_negative(columns: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Least squares; a coefficient other than the intercept (column 0) that comes out negative,
    which only noise can make it, is taken as 0 and the others refitted."""
    keep = list(range(columns.shape[1]))
    while True:
        solution = np.linalg.lstsq(columns[:, keep], observed, rcond=None)[0]
        negative = [k for k, value in zip(keep, solution, strict=True) if value < 0 and k != 0]
        if not negative:
            break
        keep.remove(negative[0])
    coefficients = np.zeros(columns.shape[1])
    coefficients[keep] = solution
    return coefficients


def prefill_step_ms(model: EngineModel, tokens: Any, cached_tokens: Any = 0) -> Any:
    """The step that prefills one prompt alone: `tokens` tokens after `cached_tokens` its prefix
    had in the cache (numbers or arrays; 0: a prompt nothing cached), as `SimEngine.step` prices it."""
    context = np.asarray(tokens) + cached_tokens
    return model.step_ms + model.prefill_ms(tokens, context) - model.prefill_overlap(tokens)


def decode_step_ms(model: EngineModel, batch: Any, context_tokens: Any) -> Any:
    """One decode step of `batch` requests over `context_tokens` in all (numbers or arrays)."""
    return model.step_ms + model.decode_ms(batch, context_tokens)


def fit_engine(
    prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample], *, kv_blocks: int, block_size: int, max_batch: int
) -> EngineFit:
    """The engine model that best explains the samples (least squares, no negative costs)."""
    if len({s.prompt_tokens for s in prefill}) < 2:
        raise ValueError("prefill samples need at least two prompt lengths")
    if len({(s.batch, s.context_tokens) for s in decode}) < 3:
        raise ValueError("decode samples need at least three (batch, context) points")
    batch = np.array([s.batch for s in decode], dtype=float)
    context = np.array([s.context_tokens for s in decode], dtype=float)
    columns = np.column_stack([np.ones_like(batch), batch, context / 1000])
    tpot = np.array([s.tpot_ms for s in decode])
    step_ms, per_seq, per_kilotoken = (max(float(v), 0.0) for v in _fit_non_negative(columns, tpot))

    # An N-token prompt: intercept + N tokens + their attention, N^2 / 2000 (see EngineModel).
    tokens = np.array([s.prompt_tokens for s in prefill], dtype=float)
    ttft = np.array([s.ttft_ms for s in prefill])
    terms = [np.ones_like(tokens), tokens]
    if len(set(tokens)) > 2:  # the quadratic term needs three prompt lengths to be told from the linear one
        terms.append(tokens**2 / 2000)
    coefficients = _fit_non_negative(np.column_stack(terms), ttft)
    intercept, per_token = float(coefficients[0]), float(coefficients[1])
    per_token_kilotoken = float(coefficients[2]) if len(coefficients) > 2 else 0.0
    overhead = max(intercept - step_ms, 0.0)
    model = EngineModel(
        step_ms=step_ms,
        prefill_ms_per_token=per_token,
        decode_ms_per_seq=per_seq,
        decode_ms_per_kilotoken=per_kilotoken,
        kv_blocks=kv_blocks,
        block_size=block_size,
        max_batch=max_batch,
        request_overhead_ms=overhead,
        prefill_ms_per_token_kilotoken=per_token_kilotoken,
    )
    prefill_predicted = overhead + prefill_step_ms(model, tokens)
    decode_predicted = decode_step_ms(model, batch, context)
    return EngineFit(model, _r2(ttft, prefill_predicted), _r2(tpot, decode_predicted))


def fit_slowdown(
    model: EngineModel, prefill_busy: Sequence[PrefillSample], decode_busy: Sequence[DecodeSample]
) -> float:
    """The engine's `neighbour_slowdown`: how much longer its steps took beside busy neighbours than
    `model`, fitted on samples taken alone, predicts. The median over the samples of observed /
    predicted step time, less 1 (a prefill's request overhead lies outside the steps); never below 0."""
    ratios = [(s.ttft_ms - model.request_overhead_ms) / prefill_step_ms(model, s.prompt_tokens) for s in prefill_busy]
    ratios += [s.tpot_ms / decode_step_ms(model, s.batch, s.context_tokens) for s in decode_busy]
    return max(0.0, float(np.median(ratios)) - 1.0) if ratios else 0.0


def save_preset(path: Path, preset: Preset, details: dict[str, Any] | None = None) -> None:
    body = {
        "name": preset.name,
        "source": preset.source,
        "engine": dataclasses.asdict(preset.engine),
        "link": dataclasses.asdict(preset.link),
        **(details or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1))


def load_preset(path: Path) -> Preset:
    """A preset `save_preset` wrote (`bench calibrate`); ValueError naming the file if it is not one."""
    try:
        body = json.loads(path.read_text())
        return Preset(str(body["name"]), EngineModel(**body["engine"]), LinkModel(**body["link"]), str(body["source"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a simulator preset written by `symphony bench calibrate`: {exc}") from None
