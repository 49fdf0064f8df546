"""Vidur's published A100 profile of Meta-Llama-3-8B (tensor parallel 1, FlashInfer attention): the
measurements the `a100-llama3.1-8b` preset's prefill is fitted to (`eval.sim.presets`).

Vidur (Agrawal et al., MLSys'24) profiles each operator of a transformer layer on the GPU and sums
them: a forward pass of the model is its 32 layers, each the layer's matrix multiplies and
element-wise operators (mlp.csv) plus its attention (attention.csv); the embedding lookup and the
CPU's part of a step are not in it. The figures below are the per-layer medians (ms) of the rows
named, copied from:

- mlp.csv: microsoft/vidur @ 7d47513363ec447a741ac5e47241580b47724fbf,
  data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv, rows with
  num_tensor_parallel_workers 1, by num_tokens; `linear_ms` is the sum of the median columns of
  input_layernorm, attn_pre_proj, attn_rope, attn_post_proj, post_attention_layernorm, mlp_up_proj,
  mlp_act, mlp_down_proj and add.
- attention.csv: the same path. microsoft/vidur keeps it in Git LFS, so it was read from the copy at
  adi-anirudh/vidur_hbf_hbm_backend @ a336807ca19bee36d2f77124b35887db661b6df1 (same path; 17.2 MB,
  max_model_len 16384), rows with batch_size 1, is_prefill True, by prefill_chunk_size and
  kv_cache_size: `kv_save_ms` the median of attn_kv_cache_save, `attention_ms` of attn_prefill.
  Where the file lists a pair twice, the two rows agree within 3%; the first is taken.

The preset's figures for a 128-token to 8,192-token prompt, against these, are the ones issue 36
quotes (1.58x-1.69x too slow at 128-512 tokens, 1.21x-1.25x at 1k-8k), which this data reproduces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eval.sim.calibration import prefill_step_ms
from eval.sim.engine import EngineModel

LAYERS = 32  # Meta-Llama-3-8B


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    """One prefill alone on the GPU: `tokens` prompt tokens computed after `cached_tokens` already
    in the cache. Per layer, in ms."""

    tokens: int
    cached_tokens: int
    linear_ms: float  # matrix multiplies, norms, rotary embedding, residual add (mlp.csv)
    kv_save_ms: float  # writing the new tokens' K and V into the paged cache (attention.csv)
    attention_ms: float  # the prefill attention kernel (attention.csv)

    @property
    def model_ms(self) -> float:
        """The whole forward pass: every layer."""
        return LAYERS * (self.linear_ms + self.kv_save_ms + self.attention_ms)


PREFILL_POINTS: tuple[ProfilePoint, ...] = (
    # A prompt nothing cached (kv_cache_size 0).
    ProfilePoint(128, 0, 0.412, 0.036, 0.015),
    ProfilePoint(256, 0, 0.609, 0.071, 0.022),
    ProfilePoint(384, 0, 0.867, 0.107, 0.030),
    ProfilePoint(512, 0, 1.0825, 0.152, 0.048),
    ProfilePoint(768, 0, 1.6545, 0.318, 0.065),
    ProfilePoint(1024, 0, 2.348, 0.554, 0.110),
    ProfilePoint(2048, 0, 4.549, 1.098, 0.310),
    ProfilePoint(3072, 0, 6.4115, 1.700, 0.602),
    ProfilePoint(4096, 0, 8.549, 2.252, 0.967),
    ProfilePoint(6144, 0, 12.979, 3.387, 2.008),
    ProfilePoint(8192, 0, 17.0365, 4.635, 3.398),
    ProfilePoint(12288, 0, 25.51, 6.692, 7.219),
    ProfilePoint(16384, 0, 33.837, 8.837, 12.488),
    # New tokens after a cached prefix (a resumed turn's prefill, or a chunk of a long one).
    ProfilePoint(576, 4608, 1.2505, 0.307, 0.408),
    ProfilePoint(576, 15552, 1.2505, 0.309, 1.229),
    ProfilePoint(960, 9600, 2.113, 0.541, 1.297),
    ProfilePoint(1024, 4096, 2.348, 0.580, 0.724),
    ProfilePoint(1024, 8192, 2.348, 0.583, 1.336),
    ProfilePoint(1024, 15360, 2.348, 0.545, 2.401),
    ProfilePoint(1600, 8000, 3.6215, 0.857, 1.431),
    ProfilePoint(2048, 6144, 4.549, 1.089, 1.676),
    ProfilePoint(4096, 12288, 8.549, 2.310, 5.632),
)
DECODE_LINEAR_MS = 0.303  # mlp.csv at num_tokens 1, per layer: one token through the weights (9.7 ms a step)


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """A lone prefill of N tokens after C cached ones, on the GPU: `max(weights_ms, fixed_ms +
    per_token_ms x N) + per_token_kilotoken_ms x N x (C + N / 2) / 1000`. The matrix multiplies cost
    a fixed part plus a part per token, and hide the read of the weights (`weights_ms`) once they take
    longer; attention grows with the tokens' positions."""

    fixed_ms: float
    per_token_ms: float
    per_token_kilotoken_ms: float

    def gpu_ms(self, weights_ms: float, tokens: float, cached_tokens: float) -> float:
        linear = max(weights_ms, self.fixed_ms + self.per_token_ms * tokens)
        return linear + self.per_token_kilotoken_ms * tokens * (cached_tokens + tokens / 2) / 1000


def fit_prefill(points: Sequence[ProfilePoint], weights_ms: float) -> PrefillFit:
    """The `PrefillFit` whose largest relative error over `points` is least (a linear program over
    the points past the weight read, where the fit is linear in its three figures; scipy's, from the
    `bench` extra)."""
    from scipy.optimize import linprog

    tokens = np.array([p.tokens for p in points], dtype=float)
    cached = np.array([p.cached_tokens for p in points], dtype=float)
    measured = np.array([p.model_ms for p in points])
    if (measured <= weights_ms).any():
        raise ValueError("every point must take longer than reading the weights")
    # Relative prediction per unknown: [fixed, per token, per token-kilotoken] / measured.
    terms = np.column_stack([np.ones_like(tokens), tokens, tokens * (cached + tokens / 2) / 1000]) / measured[:, None]
    # Minimise e subject to |terms . x - 1| <= e.
    ones = np.ones((len(points), 1))
    a_ub = np.vstack([np.hstack([terms, -ones]), np.hstack([-terms, -ones])])
    b_ub = np.concatenate([np.ones(len(points)), -np.ones(len(points))])
    result = linprog([0, 0, 0, 1], A_ub=a_ub, b_ub=b_ub, bounds=[(0, None)] * 4)
    if not result.success:
        raise ValueError(f"no fit: {result.message}")
    fixed, per_token, per_token_kilotoken, _ = (float(v) for v in result.x)
    return PrefillFit(fixed, per_token, per_token_kilotoken)


def preset_gpu_ms(engine: EngineModel, point: ProfilePoint, overhead_ms: float) -> float:
    """`engine`'s step for `point`'s prefill alone, less the step's CPU part (`overhead_ms`), which
    Vidur's model time leaves out."""
    return float(prefill_step_ms(engine, point.tokens, point.cached_tokens)) - overhead_ms
