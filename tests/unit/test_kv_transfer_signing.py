"""symphony.kv_transfer: the signature on the params the connector trusts. Only a holder of the
key signs; any change to the params, the model or the expiry breaks it; it lapses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_manager.connector.params import RequestParams, read_params
from symphony.kv_transfer import (
    AUTH_PARAM,
    PARAMS_TTL_S,
    SESSION_PARAM,
    TENANT_PARAM,
    TIERS_PARAM,
    params_key,
    params_refusal,
    sign_params,
)

KEY = params_key(b"the cluster's secret")
NOW = 1_764_000_000.0
names = st.text(min_size=1, max_size=40)
values = st.one_of(names, st.booleans(), st.integers(-(2**31), 2**31))
params_st = st.dictionaries(st.sampled_from([TENANT_PARAM, SESSION_PARAM, TIERS_PARAM, "symphony_warmup"]), values)


@given(params=params_st, model=names)
def test_a_signature_checks_out_for_what_was_signed(params: dict[str, object], model: str) -> None:
    signed = sign_params(params, model, KEY, NOW)
    assert params_refusal(signed, model, KEY, NOW) is None
    assert params_refusal(signed, model, KEY, NOW + PARAMS_TTL_S - 1) is None
    assert {k: v for k, v in signed.items() if k != AUTH_PARAM} == params  # the params themselves unchanged


@given(params=params_st, model=names, name=st.sampled_from([TENANT_PARAM, SESSION_PARAM, "extra"]), value=values)
def test_any_change_to_the_params_breaks_it(params: dict[str, object], model: str, name: str, value: object) -> None:
    signed = sign_params(params, model, KEY, NOW)
    changed = {**signed, name: value}
    if changed == signed:
        return  # no change made
    assert params_refusal(changed, model, KEY, NOW) == "forged"


@given(params=params_st, model=names, other=names)
def test_another_model_or_key_breaks_it(params: dict[str, object], model: str, other: str) -> None:
    signed = sign_params(params, model, KEY, NOW)
    if other != model:
        assert params_refusal(signed, other, KEY, NOW) == "forged"
    assert params_refusal(signed, model, params_key(b"another secret"), NOW) == "forged"


def test_it_lapses_and_its_expiry_cannot_be_moved() -> None:
    signed = sign_params({TENANT_PARAM: "acme"}, "smol", KEY, NOW)
    assert params_refusal(signed, "smol", KEY, NOW + PARAMS_TTL_S + 0.01) == "expired"
    expires, _, mac = str(signed[AUTH_PARAM]).partition(".")
    later = {**signed, AUTH_PARAM: f"{int(expires) + 60_000}.{mac}"}  # a minute more: still within reach
    assert params_refusal(later, "smol", KEY, NOW) == "forged"
    far = {**signed, AUTH_PARAM: f"{int(expires) + 3_600_000}.{mac}"}  # beyond what any signer gives
    assert params_refusal(far, "smol", KEY, NOW) == "malformed"


@pytest.mark.parametrize(
    ("auth", "reason"),
    [
        (None, "unsigned"),
        ("", "malformed"),
        ("abc.def", "malformed"),
        ("-1." + "0" * 32, "malformed"),
        ("1" * 17 + "." + "0" * 32, "malformed"),
        ("99999999999999." + "0" * 31, "malformed"),
        (f"{int(NOW * 1000) + 60_000}." + "0" * 32, "forged"),
        ("99999999999999." + "0" * 32, "malformed"),  # an expiry no signer gives
        ({"nested": 1}, "malformed"),
        ("²." + "0" * 32, "malformed"),  # a Unicode digit: int() would take it
        ("99999999999999." + "é" * 32, "malformed"),  # non-ASCII: compare_digest would raise
        ("99999999999999." + "0" * 31 + "A", "malformed"),  # the MAC is lower-case hex
    ],
)
def test_what_is_not_a_signature(auth: object, reason: str) -> None:
    params: dict[str, object] = {TENANT_PARAM: "acme"}
    if auth is not None:
        params[AUTH_PARAM] = auth
    assert params_refusal(params, "smol", KEY, NOW) == reason


def test_the_signing_key_is_not_the_secret() -> None:
    secret = b"the cluster's secret"
    assert params_key(secret) != secret and len(params_key(secret)) == 32
    assert params_key(secret) == KEY and params_key(b"other") != KEY


# ---- what the connector believes (node_manager.connector.params) ----------------------------------


def test_signed_params_are_believed() -> None:
    params = sign_params({TENANT_PARAM: "acme", SESSION_PARAM: "s", "symphony_warmup": True}, "smol", KEY, NOW)
    assert read_params(params, "r1", "smol", KEY, NOW) == RequestParams("acme", "s", warmup=True, tiers=True)
    off = sign_params({TENANT_PARAM: "acme", SESSION_PARAM: "s", TIERS_PARAM: False}, "smol", KEY, NOW)
    assert read_params(off, "r1", "smol", KEY, NOW) == RequestParams("acme", "s", warmup=False, tiers=False)


@pytest.mark.parametrize(
    ("params", "key", "refusal"),
    [
        (None, KEY, "unsigned"),
        ({TENANT_PARAM: "acme", SESSION_PARAM: "s", "symphony_warmup": True}, KEY, "unsigned"),
        (sign_params({TENANT_PARAM: "acme"}, "smol", params_key(b"a guess"), NOW), KEY, "forged"),
        ({**sign_params({TENANT_PARAM: "rival"}, "smol", KEY, NOW), TENANT_PARAM: "acme"}, KEY, "forged"),
        (sign_params({TENANT_PARAM: "acme"}, "smol", KEY, NOW - PARAMS_TTL_S - 1), KEY, "expired"),
        (sign_params({TENANT_PARAM: "acme"}, "smol", KEY, NOW), None, "no key"),
        (sign_params({TENANT_PARAM: "acme"}, "smol", b"", NOW), b"", "no key"),
        ("not a mapping", KEY, "unsigned"),
    ],
)
def test_params_not_believed_choose_nothing(params: object, key: bytes | None, refusal: str) -> None:
    """Off the tiers, and nothing of the client's: not its tenant, its session or a warm-up flag."""
    read = read_params(params, "r1", "smol", key, NOW)  # type: ignore[arg-type]
    assert read == RequestParams("default", "request-r1", warmup=False, tiers=False, refusal=refusal)


@given(
    auth=st.one_of(
        st.text(max_size=80),
        st.builds(lambda e, m: f"{e}.{m}", st.text(max_size=20), st.text(min_size=30, max_size=34)),
        st.integers(),
        st.none(),
        st.lists(st.integers(), max_size=3),
    ),
    extra=st.recursive(st.one_of(st.integers(), st.text(max_size=5), st.floats()), st.lists, max_leaves=5),
)
def test_nothing_a_client_sends_makes_the_check_raise(auth: object, extra: object) -> None:
    """It runs in vLLM's scheduler loop: Unicode digits, non-ASCII MACs, nesting, NaN all answer."""
    params = {TENANT_PARAM: "acme", "extra": extra, AUTH_PARAM: auth}
    assert params_refusal(params, "smol", KEY, NOW) in {"unsigned", "malformed", "forged", "expired"}
    assert not read_params(params, "r", "smol", KEY, NOW).tiers


def test_deep_or_huge_params_are_malformed_not_an_error() -> None:
    deep: object = 1
    for _ in range(100_000):
        deep = [deep]
    expires = str(int((NOW + 60) * 1000))
    for value in (deep, 10**5000):
        params = {TENANT_PARAM: "acme", "x": value, AUTH_PARAM: f"{expires}." + "0" * 32}
        assert params_refusal(params, "smol", KEY, NOW) == "malformed"
