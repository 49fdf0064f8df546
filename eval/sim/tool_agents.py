"""Tool-calling agent sessions for the simulator (SWE-bench-style coding agents): one session per task,
whose context grows by every step's answer and tool output.

A task opens with a prompt (system prompt, tool descriptions, the issue) of `prefix_tokens`; then
each of its `steps` LLM calls answers with a tool call of about `output_tokens`, the tool runs for
`tool_s`, and its output, about `tool_tokens`, joins the context before the next call. The agent
framework knows the next call is coming when it starts the tool, so each call's advisory leads it by
the tool's run time (as `eval.sim.agents`' predecessor hints). A user (an agent worker) runs tasks
back to back, closed loop.

Defaults, and where they come from (all configurable, `AgentShape`):
- `output_tokens` 182: the mean output of Mooncake's tool-and-agent trace, 23,608 requests of Kimi's
  agent traffic (kvcache-ai/Mooncake @ 3b5a594133958449a1feaf1c9e0fc1b553e34a28,
  FAST25-release/README.md; its mean input is 8,596 tokens);
- `steps` 40: SWE-agent's trajectories on SWE-Bench Pro run a median of 29 to 78 steps per task
  across four models (nilenso's analysis of 2,920 trajectories,
  https://nilenso.github.io/swe-bench-pro-cost-token-time-analysis/reference.html);
- `tool_tokens` 400: what a step adds beyond its answer so that a 40-step task ends near 25,000
  tokens (2,000 + 40 x 582), the middle of the 10k-40k contexts SWE-bench-style coding agents reach
  (successful mini-SWE-agent trajectories on SWE-bench Verified mostly stay under 20k: Raju et al.,
  "The Limits of Long-Context Reasoning in Automated Bug Fixing", arXiv 2602.16069); SWE-agent's file
  viewer shows 100 lines a time, some 1,000 tokens of code, and most tool outputs are shorter;
- `prefix_tokens` 2,000 and `tool_s` 5: assumptions (a system prompt with tool descriptions and an
  issue; tool runs of seconds: file views, searches, test runs), not measured figures.
Each step's answer and tool output are drawn uniformly within `jitter` (50%) of their means, seeded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from eval.sim.turns import Script, Step


@dataclass(frozen=True, slots=True)
class AgentShape:
    prefix_tokens: int = 2_000
    steps: int = 40
    output_tokens: int = 182
    tool_tokens: int = 400
    tool_s: float = 5.0
    jitter: float = 0.5  # each step's tokens drawn within this share of their mean, either way

    def __post_init__(self) -> None:
        if min(self.prefix_tokens, self.steps, self.output_tokens) < 1 or self.tool_tokens < 0 or self.tool_s < 0:
            raise ValueError(f"{self}: prefix, steps and output must be positive, tool tokens and time not negative")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter {self.jitter} must be in [0, 1)")

    def final_context_tokens(self) -> int:
        """A task's context after its last answer, at the mean sizes."""
        return self.prefix_tokens + self.steps * self.output_tokens + (self.steps - 1) * self.tool_tokens


def agent_task(shape: AgentShape, rng: random.Random, miss_rate: float = 0.0) -> tuple[Step, ...]:
    """One task's steps: the first carries the opening prompt, every later one a tool's output."""

    def around(tokens: int) -> int:
        return max(1, round(tokens * rng.uniform(1 - shape.jitter, 1 + shape.jitter)))

    tool_ms = shape.tool_s * 1000
    steps = []
    for index in range(shape.steps):
        new = shape.prefix_tokens if index == 0 else around(shape.tool_tokens)
        steps.append(Step(new, around(shape.output_tokens), tool_ms, tool_ms, rng.random() >= miss_rate))
    return tuple(steps)


def agent_users(
    shape: AgentShape,
    users: int,
    *,
    tasks_per_user: int = 4,
    stagger_ms: float = 60_000,
    miss_rate: float = 0.0,
    seed: int = 0,
) -> list[Script]:
    """One chain of `tasks_per_user` tasks per user, the first starting at a random time within
    `stagger_ms`; each task a session of its own."""
    if users < 0 or tasks_per_user < 1:
        raise ValueError("users must not be negative and each runs at least one task")
    rng = random.Random(seed)
    scripts = []
    for u in range(users):
        start_ms = rng.uniform(0, stagger_ms)
        chain: Script | None = None
        for k in reversed(range(tasks_per_user)):
            chain = Script(f"a{u}-t{k}", start_ms, agent_task(shape, rng, miss_rate), after=chain)
        assert chain is not None
        scripts.append(chain)
    return scripts
