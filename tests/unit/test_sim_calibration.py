"""Calibrating the simulator (eval.sim.calibration) and the replay `bench validate` compares with the
live cluster (eval.bench_calibrate): pure parts, on synthetic measurements."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from eval.bench_calibrate import compare, live_figures, replay_turns, sim_figures, simulate_replay
from eval.loadgen import RequestRecord
from eval.sim.calibration import DecodeSample, PrefillSample, fit_engine, fit_slowdown, load_preset, save_preset
from eval.sim.cluster import ClusterSim, LinkModel
from eval.sim.engine import EngineModel
from eval.sim.presets import Preset
from eval.sim.turns import Turn
from scheduler.policies import make_policy

TRUE = EngineModel(
    step_ms=20,
    prefill_ms_per_token=0.5,
    decode_ms_per_seq=1.5,
    decode_ms_per_kilotoken=4,
    kv_blocks=500,
    block_size=32,
    max_batch=256,
    request_overhead_ms=12,
    prefill_ms_per_token_kilotoken=0.2,
)
LINK = LinkModel(kv_bytes_per_token=1000, bandwidth_gbps=1.0, rtt_ms=0.5)


def _samples(noise: float = 0.0, seed: int = 0) -> tuple[list[PrefillSample], list[DecodeSample]]:
    rng = random.Random(seed)

    def jitter(value: float) -> float:
        return value * (1 + rng.uniform(-noise, noise))

    prefill = [
        PrefillSample(
            n,
            jitter(
                TRUE.request_overhead_ms
                + TRUE.step_ms
                + TRUE.prefill_ms_per_token * n
                + TRUE.prefill_ms_per_token_kilotoken * n * n / 2000
            ),
        )
        for n in (64, 256, 512, 1024)
        for _ in range(2)
    ]
    decode = [
        DecodeSample(
            b, b * c, jitter(TRUE.step_ms + TRUE.decode_ms_per_seq * b + TRUE.decode_ms_per_kilotoken * b * c / 1000)
        )
        for b, c in ((1, 56), (2, 56), (4, 56), (8, 56), (1, 536), (1, 1048), (4, 280))
    ]
    return prefill, decode


def test_exact_measurements_give_back_the_engine_that_made_them() -> None:
    prefill, decode = _samples()
    fit = fit_engine(prefill, decode, kv_blocks=500, block_size=32, max_batch=256)
    for field in dataclasses.fields(EngineModel):
        assert getattr(fit.model, field.name) == pytest.approx(getattr(TRUE, field.name), abs=1e-6), field.name
    assert fit.prefill_r2 == pytest.approx(1.0) and fit.decode_r2 == pytest.approx(1.0)


def test_noisy_measurements_fit_within_the_noise() -> None:
    prefill, decode = _samples(noise=0.03, seed=4)
    fit = fit_engine(prefill, decode, kv_blocks=500, block_size=32, max_batch=256)
    assert fit.model.step_ms == pytest.approx(TRUE.step_ms, rel=0.15)
    assert fit.model.prefill_ms_per_token == pytest.approx(TRUE.prefill_ms_per_token, rel=0.1)
    assert fit.decode_r2 > 0.9 and fit.prefill_r2 > 0.95


def test_a_cost_that_noise_makes_negative_is_zero_and_the_rest_refitted() -> None:
    # Decode time that does not grow with context: the context term must not come out below 0.
    decode = [DecodeSample(b, c, 20 + 1.5 * b - 0.001 * c) for b, c in ((1, 50), (2, 100), (4, 200), (1, 2000))]
    fit = fit_engine(_samples()[0], decode, kv_blocks=1, block_size=32, max_batch=8)
    assert fit.model.decode_ms_per_kilotoken == 0 and fit.model.decode_ms_per_seq > 0


def test_too_few_samples_are_refused() -> None:
    prefill, decode = _samples()
    with pytest.raises(ValueError, match="two prompt lengths"):
        fit_engine(prefill[:1], decode, kv_blocks=1, block_size=32, max_batch=8)
    with pytest.raises(ValueError, match="three"):
        fit_engine(prefill, decode[:2], kv_blocks=1, block_size=32, max_batch=8)


def test_samples_beside_busy_neighbours_give_the_slowdown_of_their_steps() -> None:
    """Steps 30% longer beside busy neighbours; a prefill's request overhead is not stretched."""
    prefill, decode = _samples()
    busy_prefill = [
        PrefillSample(s.prompt_tokens, TRUE.request_overhead_ms + 1.3 * (s.ttft_ms - TRUE.request_overhead_ms))
        for s in prefill
    ]
    busy_decode = [dataclasses.replace(s, tpot_ms=1.3 * s.tpot_ms) for s in decode]
    assert fit_slowdown(TRUE, busy_prefill, busy_decode) == pytest.approx(0.3)
    assert fit_slowdown(TRUE, prefill, decode) == pytest.approx(0.0, abs=1e-9)
    assert fit_slowdown(TRUE, [], []) == 0.0  # a one-engine cluster has no neighbours


def test_a_preset_file_round_trips_and_a_bad_one_is_named(tmp_path: Path) -> None:
    preset = Preset("local", TRUE, LINK, "test")
    save_preset(tmp_path / "p.json", preset, {"fit_r2": {"prefill": 1.0}})
    assert load_preset(tmp_path / "p.json") == preset
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    with pytest.raises(ValueError, match=r"bad\.json"):
        load_preset(tmp_path / "bad.json")


def test_a_request_reaches_the_engine_after_its_overhead() -> None:
    """Overhead 12 ms, then one step: 20 + 0.5 x 100 + 0.2 x 100^2 / 2000 = 71 ms; first token at 83 ms."""
    result = ClusterSim(make_policy("least_load"), {"n0": TRUE}, LINK).run([Turn("a", 0, 100, 1)])
    assert result.requests[0].ttft_ms == pytest.approx(83)


def _record(
    session: str, turn: int, sent: float, ttft: float, e2e: float, prompt: int, output: int, advised: bool = False
) -> RequestRecord:
    return RequestRecord(
        0,
        session,
        turn,
        sent,
        advised,
        0.5 if advised else 0.0,
        node="n0",
        ok=True,
        ttft_s=ttft,
        e2e_s=e2e,
        prompt_tokens=prompt,
        output_tokens=output,
    )


def test_the_live_requests_replay_open_loop_and_compare_figure_by_figure() -> None:
    records = [
        _record("a", 0, 1.0, 0.1, 0.5, 100, 9),
        _record("a", 1, 3.0, 0.2, 0.6, 220, 5, advised=True),
        dataclasses.replace(_record("b", 0, 2.0, 0.1, 0.1, 50, 1), ok=False),
    ]
    turns = replay_turns(records)
    assert turns == [Turn("a", 1000.0, 100, 9), Turn("a", 3000.0, 220, 5, advisory_ms=2500.0)]
    live = live_figures(records)
    assert live["ttft_ms_mean"] == pytest.approx(150)
    assert live["tpot_ms_mean"] == pytest.approx(((0.5 - 0.1) / 8 + (0.6 - 0.2) / 4) / 2 * 1000)
    assert live["output_tokens_per_s"] == pytest.approx(14 / 2.6)  # from the first send to the last answer
    simulated = sim_figures(simulate_replay(Preset("local", TRUE, LINK, "test"), "recompute", ["n0", "n1"], turns))
    assert simulated["requests"] == 2
    errors = compare(live, simulated)
    assert set(errors) == {"ttft_ms_mean", "tpot_ms_mean", "output_tokens_per_s"}
    assert errors["ttft_ms_mean"] == pytest.approx(abs(simulated["ttft_ms_mean"] - 150) / 150)
