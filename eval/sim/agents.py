"""Agent workflows for the simulator: MetaGPT-like software projects as DAGs of LLM calls.

A project: the architect writes a design from the task; `engineers` engineers, in parallel, each
implement their part of it; QA reviews all of their code; the engineers fix what the review says and
QA reviews again, `rounds` reviews in all. Every agent is a session whose context grows turn by turn
(an engineer's next turn carries its own code and the review), and a step starts only once all its
predecessors are done: the project's makespan is the time from the architect's request to QA's
last answer.

With hints, the framework tells the scheduler about each step as soon as its predecessors start (a
`predecessor` advisory: "this session's next turn comes after these finish"), so Symphony can place
the successor and move its KV while the predecessors run. Without hints, nothing is known ahead.
Not modelled: the design and code that several agents' prompts share (KV is per session here).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from eval.sim.cluster import ClusterSim
from eval.sim.engine import SimRequest
from eval.sim.turns import Turn


@dataclass(frozen=True, slots=True)
class AgentProject:
    name: str
    start_ms: float
    engineers: int = 3
    rounds: int = 3  # QA reviews, each followed by fixes except the last
    system_tokens: int = 400  # each agent's role prompt
    task_tokens: int = 200
    design_tokens: int = 600  # the architect's answer
    code_tokens: int = 400  # an engineer's answer, per round
    review_tokens: int = 200  # QA's answer, per round


def agent_projects(
    count: int, *, stagger_ms: float, seed: int = 0, engineers: int = 3, rounds: int = 3
) -> list[AgentProject]:
    """`count` projects started at random times within `stagger_ms`, with answer lengths drawn
    around the defaults (x0.5 to x1.5), seeded."""
    rng = random.Random(seed)

    def around(tokens: int) -> int:
        return max(1, round(tokens * rng.uniform(0.5, 1.5)))

    return [
        AgentProject(
            f"p{k}",
            rng.uniform(0, stagger_ms),
            engineers,
            rounds,
            task_tokens=around(200),
            design_tokens=around(600),
            code_tokens=around(400),
            review_tokens=around(200),
        )
        for k in range(count)
    ]


class ProjectRun:
    """Drives one project on a simulator: submits each step when its predecessors are done."""

    def __init__(
        self, sim: ClusterSim, project: AgentProject, hints: bool, on_finish: Callable[[ProjectRun], None] | None = None
    ) -> None:
        self.sim = sim
        self.project = project
        self.hints = hints
        self.on_finish = on_finish
        self.finished_ms: float | None = None
        self._round = 0
        self._engineer_context = [0] * project.engineers  # tokens of each engineer's session so far
        self._qa_context = 0
        self._pending = 0
        self._code_this_round = 0

    @property
    def makespan_ms(self) -> float | None:
        return None if self.finished_ms is None else self.finished_ms - self.project.start_ms

    def start(self) -> None:
        p = self.project
        architect = Turn(f"{p.name}-architect", p.start_ms, p.system_tokens + p.task_tokens, p.design_tokens)
        self.sim.submit(architect, self._designed)
        if self.hints:
            self.sim.at(p.start_ms, lambda: self._hint_engineers(p.system_tokens + p.task_tokens + p.design_tokens))

    def _engineer_turn(self, index: int, prompt: int) -> Turn:
        return Turn(f"{self.project.name}-engineer{index}", self.sim.now_ms, prompt, self.project.code_tokens)

    def _qa_turn(self, prompt: int) -> Turn:
        return Turn(f"{self.project.name}-qa", self.sim.now_ms, prompt, self.project.review_tokens)

    def _hint_engineers(self, prompt: int) -> None:
        for index in range(self.project.engineers):
            self.sim.advise(self._engineer_turn(index, prompt))

    def _designed(self, request: SimRequest) -> None:
        p = self.project
        prompt = p.system_tokens + p.task_tokens + p.design_tokens
        self._engineers_start([prompt] * p.engineers)

    def _engineers_start(self, prompts: list[int]) -> None:
        p = self.project
        self._pending = p.engineers
        self._code_this_round = 0
        for index, prompt in enumerate(prompts):
            self._engineer_context[index] = prompt
            self.sim.submit(self._engineer_turn(index, prompt), self._coded)
        if self.hints:  # QA comes after all of them: its history, then every engineer's code
            base = self._qa_context or (p.system_tokens + p.task_tokens)
            self.sim.advise(self._qa_turn(base + p.engineers * p.code_tokens))

    def _coded(self, request: SimRequest) -> None:
        self._code_this_round += request.generated
        self._pending -= 1
        if self._pending:
            return
        p = self.project
        base = self._qa_context + p.review_tokens if self._qa_context else p.system_tokens + p.task_tokens
        self._qa_context = base + self._code_this_round
        self.sim.submit(self._qa_turn(self._qa_context), self._reviewed)
        if self.hints and self._round + 1 < p.rounds:
            for index in range(p.engineers):
                self.sim.advise(self._engineer_turn(index, self._next_engineer_prompt(index)))

    def _next_engineer_prompt(self, index: int) -> int:
        p = self.project
        return self._engineer_context[index] + p.code_tokens + p.review_tokens

    def _reviewed(self, request: SimRequest) -> None:
        self._round += 1
        if self._round >= self.project.rounds:
            self.finished_ms = self.sim.now_ms
            if self.on_finish is not None:
                self.on_finish(self)
            return
        self._engineers_start([self._next_engineer_prompt(i) for i in range(self.project.engineers)])
