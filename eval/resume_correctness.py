"""Is a resumed turn the same whichever path its history's KV took?

MT-bench two-turn conversations: the first question, the model's greedy answer to it (generated
once, up front), then the second question. Each conversation's resumed turn (its second) is sent
along every path of `bench resume` (recompute, vLLM's prefix cache, Symphony's DRAM, SSD on demand,
SSD prefetched, fetched from the other node). Every Symphony path must give the token ids of vLLM's
own prefix-cache hit, with each token's logprob within `LOGPROB_TOLERANCE` of it (`identical`): it
hands vLLM the same bytes. Whether that hit also matches a recompute is reported beside it
(`identical_to_recompute`): that is vLLM's own numerics, which depend on the CPU's kernels.

vLLM's own cache holds whole blocks only; the history's partial last block reaches every path but
recompute from the node's tiers (the connector saved it when the first turn finished), so every
path gets the same bytes for every history token. The reference is still vLLM's own hit for all
the whole blocks.

The history's KV is built the way every path can build it alike: a prefill of the first turn
(question and answer). A history whose answer tokens were decoded one by one holds the decode
kernels' KV, which differs from a prefill's in the last bf16 bits; recompute would then differ from
vLLM's own prefix cache too, which is the engine's property, not a path's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from eval.resume_runner import PATHS, Node, ResumeRunner, Turn, mtbench_turns

LOGPROB_TOLERANCE = 1e-2
ANSWER_TOKENS = 64  # of the first turn's answer, so histories span several blocks
OUTPUT_TOKENS = 16  # compared per resumed turn


@dataclass(frozen=True)
class Conversation:
    history: list[int]  # the first turn, question and answer, in the chat template
    prompt: list[int]  # the history, then the second question and the assistant's cue


class TwoTurnConversations:
    """`Histories` for `ResumeRunner`: trial i is conversation i."""

    def __init__(self, conversations: list[Conversation]) -> None:
        self.conversations = conversations

    def history(self, trial: int) -> list[int]:
        return self.conversations[trial].history

    def prompt(self, trial: int) -> list[int]:
        return self.conversations[trial].prompt


def _chat_ids(
    node: Node, base_url: str, model: str, messages: list[dict[str, str]], generation_prompt: bool
) -> list[int]:
    reply = httpx.post(
        base_url + "/tokenize",
        json={"model": model, "messages": messages, "add_generation_prompt": generation_prompt},
        timeout=60,
        headers=node.engine_headers,
    )
    reply.raise_for_status()
    return list(reply.json()["tokens"])


def mtbench_conversations(node: Node, base_url: str, model: str, count: int) -> list[Conversation]:
    """The first `count` MT-bench questions with two turns, each with the model's greedy answer."""
    questions = [turns for turns in mtbench_turns() if len(turns) >= 2][:count]
    if len(questions) < count:
        raise ValueError(f"MT-bench has only {len(questions)} two-turn conversations")
    conversations = []
    for index, (first, second) in enumerate(tqdm(questions, desc="first turns", file=sys.stderr, unit="conversation")):
        opening = _chat_ids(node, base_url, model, [{"role": "user", "content": first}], True)
        answer = (
            node.engine.completions.create(
                model=model,
                prompt=opening,
                max_tokens=ANSWER_TOKENS,
                temperature=0,
                extra_body={"cache_salt": f"first-turn-{index}"},
            )
            .choices[0]
            .text
        )
        past = [{"role": "user", "content": first}, {"role": "assistant", "content": answer}]
        history = _chat_ids(node, base_url, model, past, False)
        prompt = _chat_ids(node, base_url, model, [*past, {"role": "user", "content": second}], True)
        if prompt[: len(history)] != history:
            raise RuntimeError(f"conversation {index}: the chat template does not extend the history")
        conversations.append(Conversation(history, prompt))
    return conversations


def _gap(turn: Turn, reference: Turn) -> float:
    return max((abs(a - b) for a, b in zip(turn.logprobs, reference.logprobs, strict=False)), default=0.0)


def _differing(turns: dict[str, Turn], reference: str) -> list[str]:
    """Paths whose token ids differ from `reference`'s, or whose logprobs part from them by more
    than the tolerance."""
    ref = turns[reference]
    return [
        path
        for path, turn in turns.items()
        if turn.tokens != ref.tokens or len(turn.tokens) != OUTPUT_TOKENS or _gap(turn, ref) > LOGPROB_TOLERANCE
    ]


def check_resume_correctness(
    nodes: list[Node], base_url: str, model: str, count: int, block_size: int, gap_s: float
) -> dict[str, Any]:
    conversations = mtbench_conversations(nodes[0], base_url, model, count)
    runner = ResumeRunner(
        nodes, model, TwoTurnConversations(conversations), block_size, gap_s, output_tokens=OUTPUT_TOKENS, logprobs=True
    )
    mismatched: list[int] = []  # conversations where a Symphony path parted from vLLM's own cache hit
    engine_vs_recompute: list[int] = []  # conversations where vLLM's own cache hit parted from recompute
    differing: dict[int, list[str]] = {}  # mismatched conversation -> the paths that parted
    gaps: list[float] = []
    recompute_gaps: list[float] = []
    cached: dict[str, list[int]] = {path: [] for path in PATHS}
    with tqdm(total=count * len(PATHS), desc="resume correctness", file=sys.stderr) as bar:
        for index in range(count):
            turns = {}
            for path in PATHS:
                turns[path] = runner.resumed_turn(index, path)
                cached[path].append(turns[path].cached_tokens)
                bar.update()
            # A Symphony path hands vLLM the very bytes its own prefix cache would hold, so it must
            # behave like that cache hit. Whether the hit behaves like a recompute is the engine's
            # numerics (prefill with a cached prefix runs other kernels than a full prefill): on
            # some CPUs it does to 1e-2, on others greedy paths part at near ties. Both are kept.
            symphony = {path: turn for path, turn in turns.items() if path != "recompute"}
            gaps.append(max(_gap(turn, turns["engine_cache"]) for turn in symphony.values()))
            recompute_gaps.append(_gap(turns["engine_cache"], turns["recompute"]))
            parted = _differing(symphony, "engine_cache")
            if parted:
                mismatched.append(index)
                differing[index] = parted
            if _differing({p: turns[p] for p in ("engine_cache", "recompute")}, "recompute"):
                engine_vs_recompute.append(index)
    return {
        "conversations": count,
        "paths": list(PATHS),
        "output_tokens": OUTPUT_TOKENS,
        "history_tokens": [len(c.history) for c in conversations],
        "cached_tokens": cached,
        "logprob_tolerance": LOGPROB_TOLERANCE,
        "max_logprob_gap": max(gaps),
        "mismatched_conversations": mismatched,
        "differing_paths": differing,
        "identical": not mismatched,
        "engine_cache_vs_recompute_max_logprob_gap": max(recompute_gaps),
        "engine_cache_vs_recompute_mismatched": engine_vs_recompute,
        "identical_to_recompute": not mismatched and not engine_vs_recompute,
    }
