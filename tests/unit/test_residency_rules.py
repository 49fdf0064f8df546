"""Residency rules changed at run time (symphony.residency_rules)."""

from __future__ import annotations

import pytest

from symphony.regions import build_topology
from symphony.residency_rules import (
    MAX_RESIDENCY_RULES,
    RuleError,
    known_tenants,
    listing,
    parse_update,
    with_rule,
)

TOPOLOGY = build_topology(
    ["us-east:1", "eu-west:1", "ap-south:1"],
    ["us-east~eu-west:75:1000", "us-east~ap-south:190:1000", "eu-west~ap-south:120:1000"],
    1.0,
    ["eu=eu-west"],
)
TENANTS = known_tenants(["acme:k1", "eu:k2"])


def test_a_rule_replaces_the_configurations_and_clearing_lets_the_tenant_anywhere() -> None:
    tenant, regions = parse_update({"tenant": "eu", "regions": ["ap-south", "eu-west"]}, TOPOLOGY, TENANTS)
    changed = with_rule(TOPOLOGY, tenant, regions)
    assert listing(changed) == {"eu": ["eu-west", "ap-south"]}
    assert changed.allowed("eu", "ap-south") and not changed.allowed("eu", "us-east")
    assert listing(TOPOLOGY) == {"eu": ["eu-west"]}  # the old topology is left as it was
    cleared = with_rule(changed, *parse_update({"tenant": "eu", "regions": None}, changed, TENANTS))
    assert listing(cleared) == {} and cleared.allowed("eu", "us-east")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], "body"),
        ({"regions": ["eu-west"]}, "tenant"),
        ({"tenant": "", "regions": ["eu-west"]}, "tenant"),
        ({"tenant": "a b", "regions": ["eu-west"]}, "tenant"),
        ({"tenant": "x" * 129, "regions": ["eu-west"]}, "tenant"),
        ({"tenant": "stranger", "regions": ["eu-west"]}, "tenant"),
        ({"tenant": "acme", "regions": []}, "regions"),
        ({"tenant": "acme", "regions": "eu-west"}, "regions"),
        ({"tenant": "acme", "regions": [1]}, "regions"),
        ({"tenant": "acme", "regions": ["eu-west", "mars"]}, "regions"),
        ({"tenant": "acme"}, "regions"),  # a missing list never reads as "remove the rule"
        ({"tenant": "acme", "region": ["eu-west"]}, "region"),
        ({"tenant": "acme", "regions": ["eu-west", "eu-west"]}, "regions"),
    ],
)
def test_a_bad_update_names_its_field(body: object, param: str) -> None:
    with pytest.raises(RuleError) as caught:
        parse_update(body, TOPOLOGY, TENANTS)
    assert caught.value.param == param


def test_without_api_keys_only_the_default_tenant_has_rules() -> None:
    assert known_tenants([]) == {"default"}


def test_the_rules_are_bounded_but_a_known_tenant_may_change_its_own() -> None:
    topology = TOPOLOGY
    for i in range(MAX_RESIDENCY_RULES - 1):
        topology = with_rule(topology, f"t{i}", frozenset({"us-east"}))
    with pytest.raises(OverflowError):
        with_rule(topology, "one-more", frozenset({"us-east"}))
    assert with_rule(topology, "eu", frozenset({"ap-south"})).allowed("eu", "ap-south")
