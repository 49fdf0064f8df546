"""Per-tenant quotas (symphony.tenant_quotas): token buckets, in-flight caps, overrides, bounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from symphony.config import ConfigError, load_config
from symphony.config_schema import QuotasConfig
from symphony.tenant_quotas import TenantLimits, TenantQuotas, TokenBucket, parse_overrides, quotas_from_config


def test_a_bucket_gives_its_burst_then_one_token_per_interval() -> None:
    quotas = TenantQuotas(TenantLimits(requests_per_s=2.0, request_burst=3))
    assert [quotas.take("requests", "a", 10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert quotas.take("requests", "a", 10.0) == pytest.approx(0.5)  # the next token in 1/2 s
    assert quotas.take("requests", "a", 10.25) == pytest.approx(0.25)
    assert quotas.take("requests", "a", 10.5) == 0.0
    assert quotas.take("requests", "b", 10.5) == 0.0  # every tenant has its own
    assert quotas.take("advisories", "a", 10.5) == 0.0  # no advisory rate: no limit
    assert quotas.take("requests", "a", 1000.0) == 0.0  # refilled, never past its burst
    assert [quotas.take("requests", "a", 1000.0) for _ in range(3)][-1] > 0


def test_the_burst_defaults_to_the_rate_rounded_up() -> None:
    assert TenantLimits(requests_per_s=0.2).rate("requests") == (0.2, 1.0)
    assert TenantLimits(advisories_per_s=7.5).rate("advisories") == (7.5, 8.0)


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.1, 50),
    burst=st.integers(1, 20),
    gaps=st.lists(st.floats(0, 2), min_size=1, max_size=80),
)
def test_a_bucket_never_admits_more_than_its_burst_plus_its_rate(rate: float, burst: int, gaps: list[float]) -> None:
    bucket = TokenBucket(float(burst), 0.0)
    now, admitted = 0.0, 0
    for gap in gaps:
        now += gap
        wait = bucket.take(rate, float(burst), now)
        assert wait >= 0
        admitted += wait == 0.0
        if wait > 0:  # after the wait it says, a token is there
            probe = TokenBucket(bucket.tokens, bucket.updated_s)
            assert probe.take(rate, float(burst), now + wait + 1e-9) == 0.0
    assert admitted <= burst + rate * now + 1e-6


def test_inflight_caps_are_per_tenant_and_forget_idle_tenants() -> None:
    quotas = TenantQuotas(TenantLimits(max_inflight=2), {"big": TenantLimits(max_inflight=0)})
    assert quotas.enter("a") and quotas.enter("a")
    assert not quotas.enter("a")  # at its cap: nothing counted
    assert quotas.inflight("a") == 2
    assert all(quotas.enter("big") for _ in range(50))  # its own: no cap
    quotas.leave("a")
    assert quotas.enter("a")
    for _ in range(3):
        quotas.leave("a")
    for _ in range(50):
        quotas.leave("big")
    assert quotas.inflight("a") == 0 and not quotas._inflight


def test_the_slowest_rate_keeps_retry_after_finite_and_short() -> None:
    quotas = TenantQuotas(TenantLimits(requests_per_s=0.001))
    assert quotas.take("requests", "a", 0.0) == 0.0
    assert quotas.take("requests", "a", 0.0) == pytest.approx(1000.0)
    for rate in (5e-324, 1e-4, 1e7, float("inf"), float("nan"), -1.0):
        assert TenantLimits(requests_per_s=rate).error() is not None, rate
    for weight in (0.0, 1e-320, 1e-4, 1e4, float("inf"), float("nan")):
        assert TenantLimits(weight=weight).error() is not None, weight


def test_overrides_parse_and_name_what_is_wrong() -> None:
    default = TenantLimits(requests_per_s=5)
    parsed = parse_overrides(["acme:max_inflight=4, weight=2.5"], default)
    assert parsed["acme"] == TenantLimits(requests_per_s=5, max_inflight=4, weight=2.5)
    for entry, fragment in [
        ("acme", "tenant:key=value"),
        ("acme:colour=red", "'colour=red'"),
        ("acme:max_inflight=1.5", "whole number"),
        ("acme:weight=-1", "weight: must be in"),
        ("acme:requests_per_s=nan", "requests_per_s"),
        ("acme:weight=1,weight=2", "weight is given twice"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            parse_overrides([entry], default)
    with pytest.raises(ValueError, match="twice"):
        parse_overrides(["a:weight=1", "a:weight=2"], default)


def test_the_configuration_is_checked_when_loaded() -> None:
    keys = {"api_keys": ["acme:k1"]}
    config = load_config(env={}, overrides={"scheduler": keys, "quotas": {"tenants": ["acme:weight=3"]}})
    assert quotas_from_config(config.quotas, frozenset({"acme"})).limits("acme").weight == 3.0
    for quotas, fragment in [
        ({"tenants": ["rival:weight=3"]}, "quotas.tenants: tenant 'rival' has no API key"),
        ({"max_inflight": -1}, "quotas.max_inflight"),
        ({"weight": 0}, "quotas.weight"),
        ({"requests_per_s": 5e-324}, "quotas.requests_per_s"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            load_config(env={}, overrides={"scheduler": keys, "quotas": quotas})
    env = {"SYMPHONY_QUOTAS_REQUESTS_PER_S": "2.5"}
    assert load_config(env=env).quotas.requests_per_s == 2.5
    # An entry of several settings comes through the environment as JSON.
    env = {"SYMPHONY_QUOTAS_TENANTS": '["default:max_inflight=4,weight=2"]'}
    assert load_config(env=env).quotas.tenants == ["default:max_inflight=4,weight=2"]
    assert QuotasConfig().requests_per_s == 0  # off unless configured
