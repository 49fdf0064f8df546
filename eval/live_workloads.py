"""The workloads `bench cluster` replays on the live cluster, each prepared once per repeat (seeded by
the repeat's `LoadSettings.seed`, so every policy of a repeat gets the same one) into a description
and a maker of load generators:

- `ChatWorkload`: ShareGPT users with human timing and typing advisories (`eval.loadgen`), plain
  (`sharegpt`) or skewed (`skewed`: a few heavy users among light ones, `eval.skewed`);
- `SharedPrefixWorkload`: shared-prefix groups, open-loop Poisson arrivals (`eval.open_loop`);
- `TraceWorkload`: a Mooncake trace replayed live, open loop (`eval.open_loop`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from eval.loadgen import LoadGenerator, LoadSettings, OpenLoopGenerator, RequestRecord
from eval.open_loop import SharedPrefixSettings, TraceReplaySettings, shared_prefix_requests, trace_requests
from eval.skewed import SkewSettings, skewed_plans
from eval.traces import TraceRequest
from eval.workloads import Conversation, HumanTiming


class Runner(Protocol):
    async def run(self) -> list[RequestRecord]: ...


# (scheduler URL, served model name, API key, session prefix) -> a load generator for one policy run
MakeRunner = Callable[[str, str, str, str], Runner]


@dataclass(frozen=True, slots=True)
class Prepared:
    info: dict[str, Any]  # what this repeat's workload is (recorded with the repeat)
    make: MakeRunner


class LiveWorkload(Protocol):
    kind: str

    def prepare(self, settings: LoadSettings) -> Prepared: ...


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    conversations: list[Conversation]
    timing: HumanTiming
    skew: SkewSettings | None = None

    @property
    def kind(self) -> str:
        return "sharegpt" if self.skew is None else "skewed"

    def prepare(self, settings: LoadSettings) -> Prepared:
        plans = (
            None
            if self.skew is None
            else skewed_plans(
                self.conversations,
                settings.users,
                self.skew,
                max_answer_tokens=settings.max_answer_tokens,
                seed=settings.seed,
            )
        )
        info: dict[str, Any] = {"kind": self.kind, "conversations": len(self.conversations)}
        if plans is not None:
            info["heavy_users"] = [u for u, plan in enumerate(plans) if plan.heavy]

        def make(url: str, model: str, key: str, prefix: str) -> Runner:
            return LoadGenerator(
                url, model, self.conversations, self.timing, settings, api_key=key, session_prefix=prefix, plans=plans
            )

        return Prepared(info, make)


def _open_loop(requests: list[Any], info: dict[str, Any], settings: LoadSettings) -> Prepared:
    def make(url: str, model: str, key: str, prefix: str) -> Runner:
        return OpenLoopGenerator(url, model, requests, settings, api_key=key, session_prefix=prefix)

    return Prepared(info, make)


@dataclass(frozen=True, slots=True)
class SharedPrefixWorkload:
    settings: SharedPrefixSettings
    kind: str = "shared-prefix"

    def prepare(self, settings: LoadSettings) -> Prepared:
        requests, info = shared_prefix_requests(
            self.settings, duration_s=settings.duration_s, max_tokens=settings.max_answer_tokens, seed=settings.seed
        )
        return _open_loop(requests, {"kind": self.kind, **info}, settings)


@dataclass(frozen=True, slots=True)
class TraceWorkload:
    trace: list[TraceRequest]
    settings: TraceReplaySettings
    path: str
    kind: str = "trace"

    def prepare(self, settings: LoadSettings) -> Prepared:
        requests, info = trace_requests(
            self.trace,
            self.settings,
            duration_s=settings.duration_s,
            max_tokens=settings.max_answer_tokens,
            seed=settings.seed,
        )
        return _open_loop(requests, {"kind": self.kind, "trace": self.path, **info}, settings)
