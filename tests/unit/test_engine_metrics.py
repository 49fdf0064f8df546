"""node_manager.engine_metrics: reading running/waiting/KV usage from vLLM's Prometheus text."""

from __future__ import annotations

import pytest

from node_manager.engine_metrics import EngineLoad, MetricsFormatError, parse_engine_load

REALISTIC = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 3.0
vllm:num_requests_running{engine="1",model_name="smollm2"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 4.0 1712345678901
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="smollm2",reason="capacity"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="smollm2",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="my model {v2}"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_cpu_blocks="None",\
num_gpu_blocks="1456",num_gpu_blocks_override="None"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="smollm2"} 98765.0
"""


def gauges(running: str = "0", waiting: str = "0", kv: str = "0") -> str:
    return f"vllm:num_requests_running {running}\nvllm:num_requests_waiting {waiting}\nvllm:kv_cache_usage_perc {kv}\n"


def test_parses_realistic_vllm_exposition() -> None:
    # running sums two label sets, waiting ignores waiting_by_reason and the timestamp,
    # kv usage is read past a label value holding spaces and braces.
    # The cache config's num_gpu_blocks (not num_gpu_blocks_override, nor num_cpu_blocks) times its block size.
    assert parse_engine_load(REALISTIC) == EngineLoad(running=5, waiting=4, kv_usage=0.25, kv_tokens=1456 * 32)


@pytest.mark.parametrize(
    ("sample", "tokens"),
    [
        ('vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n', 1600),
        (
            'vllm:cache_config_info{engine="0",block_size="32",num_gpu_blocks="10"} 1.0\n'
            'vllm:cache_config_info{engine="1",block_size="32",num_gpu_blocks="20"} 1.0\n',
            960,
        ),
        ('vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="None"} 1.0\n', 0),
        ('vllm:cache_config_info{engine="0",num_gpu_blocks="100"} 1.0\n', 0),
        ('vllm:cache_config_info{block_size="32",num_gpu_blocks_override="100"} 1.0\n', 0),
        ("", 0),
    ],
    ids=["one-engine", "engines-summed", "blocks-unset", "no-block-size", "override-only", "absent"],
)
def test_kv_capacity_comes_from_the_cache_config_labels(sample: str, tokens: int) -> None:
    # Optional: an engine without the info gauge (or with it unset) reports 0 tokens, not an error.
    assert parse_engine_load(gauges() + sample).kv_tokens == tokens


def test_waiting_by_reason_is_not_counted_as_waiting() -> None:
    text = gauges(waiting="1") + 'vllm:num_requests_waiting_by_reason{reason="capacity"} 7\n'
    assert parse_engine_load(text).waiting == 1


def test_label_sets_of_one_gauge_are_summed() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 1\n'
        'vllm:num_requests_running{engine="1"} 2\n'
        'vllm:num_requests_waiting{engine="0"} 3\n'
        'vllm:num_requests_waiting{engine="1"} 4\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.1\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.2\n'
    )
    load = parse_engine_load(text)
    assert (load.running, load.waiting) == (3, 7)
    assert load.kv_usage == pytest.approx(0.3)


def test_trailing_timestamp_is_not_taken_as_the_value() -> None:
    text = gauges().replace("vllm:num_requests_running 0", "vllm:num_requests_running 6 1712345678901")
    assert parse_engine_load(text).running == 6


def test_label_value_with_spaces() -> None:
    text = gauges() + 'vllm:num_requests_waiting{model_name="a b c"} 2 1712345678901\n'
    assert parse_engine_load(text).waiting == 2


def test_unlabelled_samples() -> None:
    assert parse_engine_load(gauges("1", "2", "0.5")) == EngineLoad(1, 2, 0.5)


@pytest.mark.parametrize(("kv", "expected"), [("1.7", 1.0), ("-0.2", 0.0), ("1", 1.0), ("0", 0.0)])
def test_kv_usage_is_clamped_to_unit_interval(kv: str, expected: float) -> None:
    assert parse_engine_load(gauges(kv=kv)).kv_usage == expected


@pytest.mark.parametrize("name", ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"])
def test_missing_gauge_is_named(name: str) -> None:
    text = "\n".join(line for line in gauges().splitlines() if not line.startswith(name + " "))
    with pytest.raises(MetricsFormatError, match=f"lack {name}$"):
        parse_engine_load(text)


def test_help_and_type_lines_alone_do_not_count_as_gauges() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
        "vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
    )
    with pytest.raises(MetricsFormatError, match="vllm:num_requests_running"):
        parse_engine_load(text)


def test_waiting_by_reason_does_not_stand_in_for_missing_waiting() -> None:
    text = (
        "vllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 1\n'
    )
    with pytest.raises(MetricsFormatError, match="vllm:num_requests_waiting"):
        parse_engine_load(text)


def test_empty_text_names_all_three_gauges() -> None:
    with pytest.raises(MetricsFormatError) as excinfo:
        parse_engine_load("")
    message = str(excinfo.value)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in message


@pytest.mark.parametrize(
    "bad_line",
    ["vllm:num_requests_running lots", "vllm:num_requests_running", 'vllm:num_requests_running{engine="0"}'],
    ids=["garbage", "no-value", "labels-no-value"],
)
def test_unparseable_sample_is_a_metrics_format_error(bad_line: str) -> None:
    text = bad_line + "\n" + gauges().split("\n", 1)[1]
    with pytest.raises(MetricsFormatError, match="unparseable"):
        parse_engine_load(text)


@pytest.mark.parametrize("value", ["NaN", "+Inf"])
def test_non_finite_count_is_a_metrics_format_error(value: str) -> None:
    with pytest.raises(MetricsFormatError):
        parse_engine_load(gauges(running=value))


def test_nan_kv_usage_is_not_passed_on() -> None:
    with pytest.raises(MetricsFormatError, match="non-finite"):
        parse_engine_load(gauges(kv="NaN"))
