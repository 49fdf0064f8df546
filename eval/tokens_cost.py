"""What the scheduler's token ids cost per request (`python -m eval.tokens_cost --out f.json`).

On the served model's tokenizer (default: the prepared SmolLM2), with ShareGPT text: a first turn of
~2,000 tokens (tokenized whole: there is nothing before it), new text every run, and the same one
again and again (a system prompt many sessions share: `scheduler.piece_encoder` keeps long pieces
whole); and the last turn of a 20-turn conversation tokenized whole and incrementally from turn 19
(`scheduler.incremental`), each as the tokenizer thread's work (template, tokenizing, cache) in µs.
Runs after the first find the tokenizer's word cache warm, as a running scheduler's is; no run but
the repeated first turn's finds its text's long pieces cached. Then the same through
`TokenService.request_token_ids` from an event loop: the wall time a caller waits (the work plus the
hand-over to the tokenizer thread and back) and the CPU the loop's own thread spends per request,
which is all the loop pays with the work on a thread of its own (run inline, the loop would be
blocked for the whole work instead).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eval.results import Result, write_result
from eval.workloads import SHAREGPT_SAMPLE
from scheduler.incremental import encode
from scheduler.metrics import SchedulerMetrics
from scheduler.prompt_render import chat_prompt
from scheduler.tokenizer_load import ModelTokenizer, load_model_tokenizer
from scheduler.tokens import TokenService
from symphony.config import default_home
from symphony.models import default_model_dir

MODEL = "model"


def _texts() -> list[str]:
    texts = []
    for line in SHAREGPT_SAMPLE.read_text().splitlines():
        texts += [turn["value"] for turn in json.loads(line)["conversations"] if turn["value"].strip()]
    return texts


def _take(pool: itertools.cycle[str], tokenizer: ModelTokenizer, tokens: int) -> str:
    """ShareGPT text of about `tokens` tokens."""
    text = ""
    while len(tokenizer.encode(text, False)) < tokens:
        text += next(pool) + "\n"
    ids = tokenizer.encode(text, False)[:tokens]
    return str(tokenizer.tokenizer.decode(ids))


def _new_texts(tokenizer: ModelTokenizer, count: int, tokens: int) -> list[str]:
    """`count` different texts of `tokens` tokens: the ShareGPT text from random offsets."""
    corpus, rng = "\n".join(_texts()), random.Random(0)
    texts: set[str] = set()
    while len(texts) < count:
        start = rng.randrange(len(corpus) - 16 * tokens)
        texts.add(str(tokenizer.tokenizer.decode(tokenizer.encode(corpus[start : start + 8 * tokens], False)[:tokens])))
    return sorted(texts)


def _workload(tokenizer: ModelTokenizer, runs: int) -> dict[str, list[dict[str, str]]]:
    pool = itertools.cycle(_texts())
    first = [{"role": "user", "content": _take(pool, tokenizer, 2000)}]
    new = _new_texts(tokenizer, runs + 1, 2000)
    firsts = {f"first{i}": [{"role": "user", "content": text}] for i, text in enumerate(new)}
    conversation = [{"role": "system", "content": "You are a helpful assistant."}]
    turns = []
    for _ in range(20):
        conversation.append({"role": "user", "content": _take(pool, tokenizer, 80)})
        turns.append(list(conversation))
        conversation.append({"role": "assistant", "content": _take(pool, tokenizer, 200)})
    return {"first": first, "turn19": turns[18], "turn20": turns[19], **firsts}


def _us(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median": round(statistics.median(ordered) * 1e6, 1),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e6, 1),
    }


def _time(work: Callable[[int], Any], runs: int, before: Callable[[], Any] = lambda: None) -> list[float]:
    """`work(run)` timed for runs 1..`runs` (run 0 warms up), `before()` untimed before each."""
    samples = []
    for run in range(runs + 1):
        before()
        started = time.perf_counter()
        work(run)
        if run:
            samples.append(time.perf_counter() - started)
    return samples


def measure_work(tokenizer: ModelTokenizer, workload: dict[str, list[dict[str, str]]], runs: int) -> Result:
    """The tokenizer thread's work per request, in µs, called directly."""

    def whole(messages: Callable[[int], list[dict[str, str]]]) -> Callable[[int], Any]:
        def work(run: int) -> Any:
            prompt = chat_prompt(tokenizer.tokenizer, {"messages": messages(run)})
            return encode(tokenizer.encode, tokenizer.boundaries, MODEL, prompt.text, False, None)

        return work

    def forget() -> None:  # new text each run: none of its long pieces seen before
        if tokenizer.pieces is not None:
            tokenizer.pieces.forget_segments()

    turn19 = chat_prompt(tokenizer.tokenizer, {"messages": workload["turn19"]})
    previous, _ = encode(tokenizer.encode, tokenizer.boundaries, MODEL, turn19.text, False, None)

    def incremental(run: int) -> Any:
        prompt = chat_prompt(tokenizer.tokenizer, {"messages": workload["turn20"]})
        encoded, mode = encode(tokenizer.encode, tokenizer.boundaries, MODEL, prompt.text, False, previous)
        assert mode == "incremental"
        return encoded

    render = _time(lambda _run: chat_prompt(tokenizer.tokenizer, {"messages": workload["turn20"]}), runs)
    return {
        "first_turn_full": _us(_time(whole(lambda run: workload[f"first{run}"]), runs)),
        "first_turn_repeated": _us(_time(whole(lambda _run: workload["first"]), runs)),
        "turn20_full": _us(_time(whole(lambda _run: workload["turn20"]), runs, forget)),
        "turn20_incremental": _us(_time(incremental, runs, forget)),
        "turn20_template_only": _us(render),
    }


async def measure_service(path: Path, workload: dict[str, list[dict[str, str]]], runs: int) -> Result:
    """Through TokenService from the loop: a caller's wall time and the loop thread's CPU, in µs."""
    metrics = SchedulerMetrics()
    service = TokenService({MODEL: path}, metrics, cache_sessions=10 * runs, cache_tokens=10**8, timeout_s=10)
    service.start()
    await service.loaded()
    out: Result = {}
    try:
        for name, before, body in (
            ("first_turn_full", None, None),
            ("turn20_incremental", workload["turn19"], workload["turn20"]),
        ):
            wall, loop_cpu = [], []
            for i in range(runs + 1):
                session = f"{name}-{i}"
                if before is not None:
                    await service.request_token_ids("t", session, MODEL, {"messages": before})
                messages = body if body is not None else workload[f"first{i}"]  # new text every run
                started, cpu = time.perf_counter(), time.thread_time()
                ids = await service.request_token_ids("t", session, MODEL, {"messages": messages})
                if i:  # the first one warms up
                    wall.append(time.perf_counter() - started)
                    loop_cpu.append(time.thread_time() - cpu)
                assert ids is not None
            out[name] = {"wall": _us(wall), "loop_thread_cpu": _us(loop_cpu)}
    finally:
        service.stop()
    return out


def measure(path: Path, runs: int) -> Result:
    tokenizer = load_model_tokenizer(MODEL, path)
    workload = _workload(tokenizer, runs)
    counts = {
        name: len(tokenizer.encode(chat_prompt(tokenizer.tokenizer, {"messages": m}).text, False))
        for name, m in workload.items()
        if name in ("first", "turn19", "turn20")
    }
    return {
        "model": str(path),
        "runs": runs,
        "prompt_tokens": counts,
        "work_us": measure_work(tokenizer, workload, runs),
        "service_us": asyncio.run(measure_service(path, workload, runs)),
    }


def _table(result: Result) -> None:
    print(f"{result['model']}: prompt tokens {result['prompt_tokens']} ({result['runs']} runs, µs median / p90)")
    for name, figures in result["work_us"].items():
        print(f"  work     {name:<22} {figures['median']:>9.1f} {figures['p90']:>9.1f}")
    for name, figures in result["service_us"].items():
        for what, values in figures.items():
            print(f"  service  {name:<22} {what:<16} {values['median']:>9.1f} {values['p90']:>9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_dir(default_home()), help="model folder")
    parser.add_argument("--runs", type=int, default=200, help="requests timed per figure (200)")
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    args = parser.parse_args()
    write_result(measure(args.model, args.runs), args.out, table=_table)


if __name__ == "__main__":
    main()
