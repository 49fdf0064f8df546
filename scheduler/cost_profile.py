"""What serving costs on this cluster, measured: the figures the `symphony` policy turns into an
estimated time to first token. Pure values, parsing and checks; no I/O (`scheduler.profile_loader`
reads the file, `symphony bench calibrate` measures and writes it, the simulator builds one from its
preset).

The file is JSON, the fields of `CostProfile` (nested ones as objects), e.g.

    {"version": 1, "measured_at_unix_s": 1795000000.0, "host": "gpu-7", "model": "SmolLM2-135M-Instruct",
     "source": "symphony bench calibrate ...", "request_overhead_ms": 54.2, "step_ms": 18.0,
     "prefill_ms_per_token": 0.364, "prefill_ms_per_token_kilotoken": 1.12, "decode_ms_per_seq": 0.94,
     "decode_ms_per_kilotoken": 4.38, "engine_kv_tokens": 46592, "kv_bytes_per_token": 23040,
     "tier_load_ms_per_token": {"engine": 0.0, "hbm": 0.00097, "dram": 0.00145, "ssd": 0.0119},
     "default_link": {"rtt_ms": 0.5, "bandwidth_gbps": 2.0},
     "links": [{"source": "node-0", "target": "node-1", "rtt_ms": 0.4, "bandwidth_gbps": 2.1}]}

Every key is required but `links` (node pairs not listed use `default_link`); unknown keys are
refused, so a misspelt one is not silently replaced by nothing.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

PROFILE_VERSION = 1
KILO = 1000.0


class ProfileError(ValueError):
    """A cost profile file that cannot be used; the message names the field and the problem."""


@dataclass(frozen=True, slots=True)
class TierLoadCosts:
    """Milliseconds to bring one token's KV from a tier of a node into that node's engine (all
    layers; the connector's load of that tier, as `bench tiers` measures it)."""

    engine: float  # already in the engine's own prefix cache: always 0
    hbm: float
    dram: float
    ssd: float


@dataclass(frozen=True, slots=True)
class LinkCost:
    """Moving KV from one node to another: a round trip, then the bytes at the link's rate."""

    rtt_ms: float
    bandwidth_gbps: float  # GB/s, 1e9 bytes per second, as a node-to-node pull achieves it

    def move_ms(self, nbytes: float) -> float:
        return self.rtt_ms + nbytes / (self.bandwidth_gbps * 1e6)


@dataclass(frozen=True, slots=True)
class NodeLink:
    """The link over which `target` pulls KV from `source` (node ids as the nodes report them)."""

    source: str
    target: str
    rtt_ms: float
    bandwidth_gbps: float  # GB/s

    @property
    def cost(self) -> LinkCost:
        return LinkCost(self.rtt_ms, self.bandwidth_gbps)


@dataclass(frozen=True, slots=True)
class CostProfile:
    """One cluster's costs, in milliseconds unless a name says otherwise. The engine's are those of
    `eval.sim.engine.EngineModel` (the simulator prices steps with the same figures): a step costs
    `step_ms + prefill + decode`, and a request pays `request_overhead_ms` outside the steps."""

    request_overhead_ms: float  # per request, outside the engine's steps (HTTP, tokenizing)
    step_ms: float  # fixed cost of one engine step
    prefill_ms_per_token: float  # per prompt token computed
    # Prefill attention: a token computed at position j costs this much more per 1,000 tokens of j.
    prefill_ms_per_token_kilotoken: float
    decode_ms_per_seq: float  # per request decoding in a step
    decode_ms_per_kilotoken: float  # per 1,000 tokens of context of the requests decoding in a step
    engine_kv_tokens: int  # tokens the engine's KV cache holds (its blocks x block size); 0: unknown
    kv_bytes_per_token: int  # one token's KV, all layers, K and V
    tier_load_ms_per_token: TierLoadCosts
    default_link: LinkCost  # node pairs `links` does not name
    links: tuple[NodeLink, ...] = ()
    measured_at_unix_s: float = 0.0  # when it was measured (Unix time, seconds); 0: never (defaults)
    host: str = ""  # the host it was measured on (its host name)
    model: str = ""  # the served model name it was measured with
    source: str = ""  # how it was made, in words
    version: int = PROFILE_VERSION
    _by_pair: dict[tuple[str, str], LinkCost] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_pair", {(link.source, link.target): link.cost for link in self.links})

    def link(self, source: str, target: str) -> LinkCost:
        """The link `target` pulls KV from `source` over."""
        return self._by_pair.get((source, target), self.default_link)

    def prefill_ms(self, computed: float, context: float) -> float:
        """Computing the last `computed` tokens of a `context`-token prompt (their mean position is
        `context - computed / 2`): `EngineModel.prefill_ms`."""
        return (
            self.prefill_ms_per_token * computed
            + self.prefill_ms_per_token_kilotoken * computed * (context - computed / 2) / KILO
        )

    def step_with(self, decoding: float, context_tokens: float) -> float:
        """One engine step that decodes a token for `decoding` requests holding `context_tokens` in all."""
        return self.step_ms + self.decode_ms_per_seq * decoding + self.decode_ms_per_kilotoken * context_tokens / KILO


# -- checks -----------------------------------------------------------------------------------------
# Wide ranges: wrong by orders of magnitude (a unit slip, a failed measurement), not merely slow.
_RANGES: dict[str, tuple[float, float]] = {
    "request_overhead_ms": (0.0, 60_000.0),
    "step_ms": (0.0, 60_000.0),
    "prefill_ms_per_token": (0.0, 1_000.0),
    "prefill_ms_per_token_kilotoken": (0.0, 1_000.0),
    "decode_ms_per_seq": (0.0, 10_000.0),
    "decode_ms_per_kilotoken": (0.0, 10_000.0),
    "engine_kv_tokens": (0, 1e10),
    "kv_bytes_per_token": (1, 1e8),
    "tier_ms_per_token": (0.0, 100.0),  # 100 ms a token: a few KB/s
    "rtt_ms": (0.0, 60_000.0),
    "bandwidth_gbps": (1e-6, 1e5),
    "unix_s": (0.0, 1e11),
}


def problems(profile: CostProfile) -> list[str]:
    """What makes `profile` implausible (empty: usable): every figure finite and within a wide range,
    some cost per prefilled token, the tiers ordered engine <= HBM <= DRAM <= SSD in cost per token."""
    found: list[str] = []

    def check(name: str, value: float, bounds: str) -> None:
        low, high = _RANGES[bounds]
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            found.append(f"{name}: {value!r} is not a finite number")
        elif not low <= value <= high:
            found.append(f"{name}: {value!r} is outside the plausible range [{low:g}, {high:g}]")

    if profile.version != PROFILE_VERSION:
        found.append(f"version: {profile.version!r} is not {PROFILE_VERSION} (re-run `symphony bench calibrate`)")
    for name in (
        "request_overhead_ms",
        "step_ms",
        "prefill_ms_per_token",
        "prefill_ms_per_token_kilotoken",
        "decode_ms_per_seq",
        "decode_ms_per_kilotoken",
        "engine_kv_tokens",
        "kv_bytes_per_token",
    ):
        check(name, getattr(profile, name), name)
    if not found and profile.prefill_ms_per_token + profile.prefill_ms_per_token_kilotoken <= 0:
        found.append("prefill_ms_per_token: prefill costs nothing, which no engine does")
    tiers = profile.tier_load_ms_per_token
    costs = [(name, getattr(tiers, name)) for name in ("engine", "hbm", "dram", "ssd")]
    for name, value in costs:
        check(f"tier_load_ms_per_token.{name}", value, "tier_ms_per_token")
    if tiers.engine != 0:
        found.append(f"tier_load_ms_per_token.engine: {tiers.engine!r}; the engine's own cache loads nothing (0)")
    if all(isinstance(v, int | float) and math.isfinite(v) for _, v in costs):
        for (upper, upper_cost), (lower, lower_cost) in itertools.pairwise(costs):
            if upper_cost > lower_cost:
                found.append(
                    f"tier_load_ms_per_token: {upper} ({upper_cost:g}) costs more than {lower} ({lower_cost:g}); "
                    "a faster tier must not load slower"
                )
    for where, rtt, bandwidth in [
        ("default_link", profile.default_link.rtt_ms, profile.default_link.bandwidth_gbps),
        *((f"links[{link.source}->{link.target}]", link.rtt_ms, link.bandwidth_gbps) for link in profile.links),
    ]:
        check(f"{where}.rtt_ms", rtt, "rtt_ms")
        check(f"{where}.bandwidth_gbps", bandwidth, "bandwidth_gbps")
    pairs = [(link.source, link.target) for link in profile.links]
    if len(set(pairs)) != len(pairs):
        found.append("links: a node pair is listed twice")
    if any(link.source == link.target for link in profile.links):
        found.append("links: a link from a node to itself")
    check("measured_at_unix_s", profile.measured_at_unix_s, "unix_s")
    return found


def staleness(profile: CostProfile, *, host: str, model: str, now_unix_s: float, max_age_s: float) -> str | None:
    """Why `profile` does not describe this cluster now (None: it does): measured longer than
    `max_age_s` ago (or in the future), on another host, or with another served model."""
    age = now_unix_s - profile.measured_at_unix_s
    if age > max_age_s:
        return f"measured {age / 86400:.1f} days ago, more than the {max_age_s / 86400:g} allowed"
    if age < -86400:
        return "measured more than a day in the future (a wrong clock)"
    if profile.host != host:
        return f"measured on host {profile.host!r}, not on this one ({host!r})"
    if profile.model != model:
        return f"measured with model {profile.model!r}, not {model!r}"
    return None


# -- JSON -------------------------------------------------------------------------------------------
def to_json(profile: CostProfile) -> str:
    return json.dumps(to_dict(profile), indent=1)


def to_dict(profile: CostProfile) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for f in fields(profile):
        if f.name.startswith("_"):
            continue
        value = getattr(profile, f.name)
        if isinstance(value, TierLoadCosts | LinkCost):
            value = {g.name: getattr(value, g.name) for g in fields(value)}
        elif f.name == "links":
            value = [{g.name: getattr(link, g.name) for g in fields(link)} for link in value]
        body[f.name] = value
    return body


def _object(where: str, raw: Any, cls: type) -> Any:
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where}: expected an object, got {raw!r}")
    names = [f.name for f in fields(cls) if not f.name.startswith("_")]
    required = [name for name in names if name != "links"]  # a file states every figure it stands for
    unknown = sorted(set(raw) - set(names))
    missing = [name for name in required if name not in raw]
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {', '.join(unknown)}")
    if missing:
        raise ProfileError(f"{where}: missing key(s) {', '.join(missing)}")
    return raw


def from_dict(raw: Any) -> CostProfile:
    """The profile a `to_dict` body describes; ProfileError naming the key if it is not one (its
    figures are not checked here: `problems`)."""
    body = dict(_object("profile", raw, CostProfile))
    try:
        body["tier_load_ms_per_token"] = TierLoadCosts(
            **_object("tier_load_ms_per_token", body["tier_load_ms_per_token"], TierLoadCosts)
        )
        body["default_link"] = LinkCost(**_object("default_link", body["default_link"], LinkCost))
        links = body.get("links", [])
        if not isinstance(links, list):
            raise ProfileError(f"links: expected a list, got {links!r}")
        body["links"] = tuple(NodeLink(**_object(f"links[{i}]", link, NodeLink)) for i, link in enumerate(links))
        for i, link in enumerate(body["links"]):
            for end in ("source", "target"):
                if not isinstance(getattr(link, end), str):
                    raise ProfileError(f"links[{i}].{end}: expected a string, got {getattr(link, end)!r}")
        for name in ("host", "model", "source"):
            if not isinstance(body.get(name, ""), str):
                raise ProfileError(f"{name}: expected a string, got {body[name]!r}")
        return CostProfile(**body)
    except TypeError as exc:  # pragma: no cover - _object checked every key
        raise ProfileError(str(exc)) from None


def from_json(text: str) -> CostProfile:
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ProfileError(f"not JSON: {exc}") from None
    return from_dict(raw)


# -- what `symphony status` shows ------------------------------------------------------------------
def summary(profile: CostProfile) -> dict[str, Any]:
    """The figures an operator checks at a glance, with their units."""
    return {
        "measured_at_unix_s": profile.measured_at_unix_s,
        "host": profile.host,
        "model": profile.model,
        "source": profile.source,
        "prefill_ms_1k_tokens": round(profile.prefill_ms(1000, 1000), 1),
        "prefill_ms_per_token": profile.prefill_ms_per_token,
        "prefill_ms_per_token_kilotoken": profile.prefill_ms_per_token_kilotoken,
        "request_overhead_ms": profile.request_overhead_ms,
        "decode_step_ms": {"fixed": profile.step_ms, "per_seq": profile.decode_ms_per_seq},
        "tier_load_us_per_token": {
            f.name: round(getattr(profile.tier_load_ms_per_token, f.name) * 1000, 3)
            for f in fields(profile.tier_load_ms_per_token)
        },
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "default_link": {"rtt_ms": profile.default_link.rtt_ms, "bandwidth_gbps": profile.default_link.bandwidth_gbps},
        "links": len(profile.links),
    }


# -- defaults ---------------------------------------------------------------------------------------
SMOLLM2_KV_BYTES_PER_TOKEN = 23_040  # 30 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes (bf16)
# The profile used when none is loaded: the development host (2 shared cores, vLLM CPU, the default
# SmolLM2-135M-Instruct), from `bench calibrate` and `bench tiers` on 2026-11-26
# (docs/benchmarks.md#bench-calibrate-and-bench-validate). On any other host or model these are
# guesses of the right order at best; `symphony bench calibrate` measures the host's own.
DEFAULT_PROFILE = CostProfile(
    request_overhead_ms=54.2,
    step_ms=18.0,
    prefill_ms_per_token=0.364,
    prefill_ms_per_token_kilotoken=1.12,
    decode_ms_per_seq=0.94,
    decode_ms_per_kilotoken=4.38,
    engine_kv_tokens=1456 * 32,  # 1 GiB of KV space (engine.kv_cache_space_gib) in 32-token blocks
    kv_bytes_per_token=SMOLLM2_KV_BYTES_PER_TOKEN,
    # bench tiers: memcpy 23.7 GB/s (HBM is host memory on a CPU host), DRAM load 15.9, SSD read 1.94.
    tier_load_ms_per_token=TierLoadCosts(
        engine=0.0,
        hbm=SMOLLM2_KV_BYTES_PER_TOKEN / 23.7e6,
        dram=SMOLLM2_KV_BYTES_PER_TOKEN / 15.9e6,
        ssd=SMOLLM2_KV_BYTES_PER_TOKEN / 1.94e6,
    ),
    default_link=LinkCost(rtt_ms=0.2, bandwidth_gbps=2.06),  # bench tiers' peer pull over loopback
    source="built-in defaults: the development host (2 CPU cores, SmolLM2-135M-Instruct on vLLM CPU)",
)
