"""What the KV suites share: MT-bench questions, a session's KV held on a node, and the bar two
completions of the same prompt must meet (greedy tokens equal, logprobs within 1e-2)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import openai

from symphony.rpc import kv_pb2, kv_pb2_grpc

MTBENCH = Path(__file__).resolve().parents[2] / "eval" / "data" / "mtbench" / "mt_bench_question.jsonl"
BLOCK = 32


def questions(count: int) -> list[list[str]]:
    """The turns of the first `count` MT-bench questions."""
    lines = MTBENCH.read_text().splitlines()[:count]
    return [json.loads(line)["turns"] for line in lines]


def loadable_blocks(grpc_port: int, tenant: str, session: str) -> int:
    """Blocks of the session's history the node's tiers can load."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        status = kv_pb2_grpc.KVStoreStub(channel).GetSessionStatus(
            kv_pb2.SessionStatusRequest(session=kv_pb2.SessionRef(tenant=tenant, session_id=session)), timeout=5
        )
    return status.loadable_prefix_blocks


def assert_logprobs_close(a: openai.types.Completion, b: openai.types.Completion) -> None:
    a_lp, b_lp = a.choices[0].logprobs.token_logprobs, b.choices[0].logprobs.token_logprobs
    assert len(a_lp) == len(b_lp)
    assert max(abs(x - y) for x, y in zip(a_lp, b_lp, strict=True)) <= 1e-2
