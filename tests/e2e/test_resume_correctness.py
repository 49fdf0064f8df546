"""Issue 4's correctness bar: 20 MT-bench two-turn conversations, each resumed turn sent along every
path (recompute, vLLM's prefix cache, DRAM, SSD on demand, SSD prefetched, the other node). Every
Symphony path gives the greedy token ids of vLLM's own prefix-cache hit, with logprobs within 1e-2:
the same bytes, the same output. (Whether that hit matches a recompute is vLLM's numerics on the
host's CPU: reported by the check, not asserted here.)"""

from __future__ import annotations

import pytest

from eval.resume_correctness import OUTPUT_TOKENS, check_resume_correctness
from eval.resume_runner import PATHS
from tests.e2e.conftest import LiveCluster
from tests.e2e.resume_support import resume_nodes

# 120 resumed turns (20 conversations x 6 paths) at 6-9 s each on a 2-core host, after the cluster
# starts: 13-16 minutes, past the suite's 900 s default (CI at 0bc4b49 was cut at turn 115 of 120).
# A hung turn still fails on its own: every engine read has a 300 s deadline.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

CONVERSATIONS = 20
BLOCK = 32


def test_resumed_turns_match_on_every_path(live_cluster: LiveCluster) -> None:
    with resume_nodes(live_cluster) as nodes:
        result = check_resume_correctness(
            nodes,
            f"http://127.0.0.1:{live_cluster.engine_ports[0]}",
            live_cluster.model,
            CONVERSATIONS,
            BLOCK,
            gap_s=0.1,
        )
    assert result["mismatched_conversations"] == [], result["differing_paths"]
    assert result["max_logprob_gap"] <= 1e-2
    # Each path got the history from where it says, not by recomputing it: every full block of the
    # history was a cache hit on every path but recompute.
    for index, history in enumerate(result["history_tokens"]):
        assert history >= 2 * BLOCK, "histories must span blocks for the paths to differ"
        full = history // BLOCK * BLOCK
        for path in PATHS:
            hit = result["cached_tokens"][path][index]
            assert hit == 0 if path == "recompute" else hit >= full, (path, index, hit, full)
    assert result["output_tokens"] == OUTPUT_TOKENS
