"""Engine and link constants for the simulator, from published figures, with the arithmetic shown.

Model: Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): 8.03e9 parameters, 32 layers, 8 KV heads
of dimension 128; bf16 weights are 16.06 GB and each token's KV is 2 (K, V) x 32 x 8 x 128 x 2 bytes =
131,072 bytes.

Each step costs a fixed 2 ms (vLLM's scheduling and kernel launches, CUDA graphs on) plus:
- decode: one read of the weights per step plus, per request, one read of its KV, at 80% of the
  memory bandwidth; `decode_ms_per_seq` (sampling, per-request bookkeeping) is a small constant;
- prefill, A100: fitted to Vidur's measured A100 profile of Meta-Llama-3-8B (tensor parallel 1), 22
  prompts of 128 to 16,384 tokens, some after a cached prefix of up to 15,552 (`eval.sim.vidur_profile`
  holds the figures and where they come from). A lone prefill of N tokens after C cached ones takes
  `max(weights read, 3.587 + 0.07993 x N) + 0.004232 x N x (C + N / 2) / 1000` ms on the GPU: the
  matrix multiplies hide the weight read once they run longer (`prefill_overlap_ms`, the weight read
  less the 3.587 ms fixed part), and the per-token part includes writing each token's KV into the
  paged cache. Fitted to the least largest relative error: within 9.8% of every point (the old
  first-principles figure, 2 FLOPs per parameter, embedding and LM head included, at 50% of peak, on
  top of the whole step, was 1.21x-1.69x slower than the profile). The same profile's one-token pass
  through the weights, 9.7 ms (32 x 0.303), checks the decode step's weight read, 9.85 ms;
- prefill, L4: 2 FLOPs per parameter per token at 50% of the GPU's dense bf16 peak, plus its attention
  over the tokens before it: at position j, Q.K^T and the scores times V take 2 x 2 x hidden (4,096) x
  j FLOPs in each of the 32 layers, at the same utilisation; nothing overlaps. A first-principles
  estimate: no profile of this card is at hand, and it shares the A100's old flaws (about 1.2x-1.7x
  slow there).
KV capacity: vLLM's default gpu_memory_utilization of 0.9 of the card, less the weights and an
activation reserve, in blocks of 16 tokens (vLLM's GPU default).

GPU figures are NVIDIA's datasheets: A100 80GB SXM, 2,039 GB/s HBM2e and 312 TFLOPS dense bf16; L4,
300 GB/s GDDR6 and 121 TFLOPS dense bf16. Links are assumptions, stated per preset. Only the A100's
prefill is fitted to a measurement; `bench validate` compares the simulator with a live cluster only
for the locally calibrated preset.
"""

from __future__ import annotations

from dataclasses import dataclass

from eval.sim.cluster import LinkModel
from eval.sim.engine import EngineModel
from scheduler.cost_profile import CostProfile, LinkCost, NodeLink, TierLoadCosts
from scheduler.policies import make_policy
from scheduler.routing import RoutingPolicy
from symphony.kv_geometry import KVGeometry

LLAMA_8B_PARAMS = 8.03e9
LLAMA_8B_LAYERS = 32
LLAMA_8B_HIDDEN = 4096  # query heads (32) x head dimension (128)
LLAMA_8B_WEIGHT_BYTES = LLAMA_8B_PARAMS * 2
GPU_BLOCK_SIZE = 16
LLAMA_8B_KV = KVGeometry(
    num_layers=LLAMA_8B_LAYERS, kv_heads=8, head_size=128, block_size=GPU_BLOCK_SIZE, dtype="bfloat16"
)
LLAMA_8B_KV_BYTES_PER_TOKEN = int(LLAMA_8B_KV.bytes_per_token())  # 131,072
STEP_OVERHEAD_MS = 2.0
PREFILL_MFU = 0.5
BANDWIDTH_EFFICIENCY = 0.8
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    engine: EngineModel
    link: LinkModel
    source: str


def engine_cost_profile(
    engine: EngineModel,
    *,
    kv_bytes_per_token: int,
    tier_load_ms_per_token: TierLoadCosts,
    default_link: LinkCost,
    links: tuple[NodeLink, ...] = (),
    measured_at_unix_s: float = 0.0,
    host: str = "",
    model: str = "",
    source: str = "",
) -> CostProfile:
    """A cost profile whose engine figures (overhead, step, prefill, decode, KV capacity) are
    `engine`'s, the simulator's and the calibration's fitted model alike; the rest as given."""
    return CostProfile(
        request_overhead_ms=engine.request_overhead_ms,
        step_ms=engine.step_ms,
        prefill_ms_per_token=engine.prefill_ms_per_token,
        prefill_ms_per_token_kilotoken=engine.prefill_ms_per_token_kilotoken,
        decode_ms_per_seq=engine.decode_ms_per_seq,
        decode_ms_per_kilotoken=engine.decode_ms_per_kilotoken,
        engine_kv_tokens=engine.kv_blocks * engine.block_size,
        kv_bytes_per_token=kv_bytes_per_token,
        tier_load_ms_per_token=tier_load_ms_per_token,
        default_link=default_link,
        links=links,
        measured_at_unix_s=measured_at_unix_s,
        host=host,
        model=model,
        source=source,
    )


def sim_cost_profile(engine: EngineModel, link: LinkModel, source: str = "simulator") -> CostProfile:
    """The cost profile of a simulated cluster, which the `symphony` policy routes it by: the
    simulator's own engine and link, so the profile is exact there but for `prefill_overlap_ms`,
    which a cost profile has no field for (its prefill estimates are high by at most that much per
    step). Tier loads cost nothing, as the simulator takes KV loaded from a node's own tiers to be as
    good as cached (`eval.sim.cluster`)."""
    return engine_cost_profile(
        engine,
        kv_bytes_per_token=link.kv_bytes_per_token,
        tier_load_ms_per_token=TierLoadCosts(engine=0.0, hbm=0.0, dram=0.0, ssd=0.0),
        default_link=LinkCost(rtt_ms=link.rtt_ms, bandwidth_gbps=link.bandwidth_gbps),
        source=source,
    )


def sim_policy(name: str, preset: Preset) -> RoutingPolicy:
    """Policy `name` as the simulator runs it on `preset`'s engines: priced by their own costs."""
    return make_policy(name, profile=sim_cost_profile(preset.engine, preset.link, f"simulator preset {preset.name}"))


@dataclass(frozen=True, slots=True)
class MeasuredPrefill:
    """A lone prefill's GPU time, fitted to a profile (`eval.sim.vidur_profile.PrefillFit`): its
    matrix multiplies take `fixed_ms + per_token_ms x N`, or the weight read if that is longer."""

    fixed_ms: float
    per_token_ms: float
    per_token_kilotoken_ms: float


# `eval.sim.vidur_profile.fit_prefill(PREFILL_POINTS, weights read)`, rounded (tests/unit check it).
A100_LLAMA3_8B_PREFILL = MeasuredPrefill(fixed_ms=3.587, per_token_ms=0.07993, per_token_kilotoken_ms=0.004232)


def _gpu_engine(
    memory_gb: float,
    bandwidth_gbps: float,
    tflops: float,
    activation_gb: float,
    prefill: MeasuredPrefill | None = None,
) -> EngineModel:
    bandwidth = bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY  # bytes/s actually achieved
    kv_bytes = memory_gb * 1e9 * GPU_MEMORY_UTILIZATION - LLAMA_8B_WEIGHT_BYTES - activation_gb * 1e9
    weights_ms = LLAMA_8B_WEIGHT_BYTES / bandwidth * 1000
    if prefill is None:  # first principles: every parameter's FLOPs at PREFILL_MFU, nothing overlapped
        per_token = 2 * LLAMA_8B_PARAMS / (tflops * 1e12 * PREFILL_MFU) * 1000
        per_token_kilotoken = 4 * LLAMA_8B_HIDDEN * LLAMA_8B_LAYERS * 1000 / (tflops * 1e12 * PREFILL_MFU) * 1000
        overlap = 0.0
    else:
        per_token, per_token_kilotoken = prefill.per_token_ms, prefill.per_token_kilotoken_ms
        overlap = weights_ms - prefill.fixed_ms
    return EngineModel(
        step_ms=STEP_OVERHEAD_MS + weights_ms,
        prefill_ms_per_token=per_token,
        prefill_ms_per_token_kilotoken=per_token_kilotoken,
        prefill_overlap_ms=overlap,
        decode_ms_per_seq=0.05,
        decode_ms_per_kilotoken=LLAMA_8B_KV_BYTES_PER_TOKEN * 1000 / bandwidth * 1000,
        kv_blocks=int(kv_bytes // LLAMA_8B_KV.block_bytes),
        block_size=GPU_BLOCK_SIZE,
        max_batch=256,  # vLLM's max_num_seqs default
    )


PRESETS: dict[str, Preset] = {
    "a100-llama3.1-8b": Preset(
        "a100-llama3.1-8b",
        _gpu_engine(memory_gb=80, bandwidth_gbps=2039, tflops=312, activation_gb=4, prefill=A100_LLAMA3_8B_PREFILL),
        # Assumed: nodes on 100 Gb/s RDMA in one region, 80% of line rate, 50 us round trip.
        LinkModel(LLAMA_8B_KV_BYTES_PER_TOKEN, bandwidth_gbps=10.0, rtt_ms=0.05),
        "NVIDIA A100 80GB SXM datasheet; Llama-3.1-8B config.json; prefill fitted to Vidur's A100 profile "
        "of Meta-Llama-3-8B (eval/sim/vidur_profile.py); see eval/sim/presets.py",
    ),
    "l4-llama3.1-8b": Preset(
        "l4-llama3.1-8b",
        _gpu_engine(memory_gb=24, bandwidth_gbps=300, tflops=121, activation_gb=1.5),
        # Assumed: cloud VMs on 25 Gb/s Ethernet, 80% of line rate, 200 us round trip.
        LinkModel(LLAMA_8B_KV_BYTES_PER_TOKEN, bandwidth_gbps=2.5, rtt_ms=0.2),
        "NVIDIA L4 datasheet; Llama-3.1-8B config.json; see eval/sim/presets.py",
    ),
}
