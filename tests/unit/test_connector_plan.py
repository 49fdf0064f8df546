"""node_manager.connector.plan: the connector's per-step load and save bookkeeping (pure logic)."""

from __future__ import annotations

import pytest

from node_manager.connector.plan import ConnectorPlanner, LoadSpec, SaveSpec, TailSave, external_tokens

BS = 4
KEYS = (b"k0", b"k1", b"k2")  # stand-ins for the held blocks' keys: loads name their last block's


@pytest.mark.parametrize(
    ("held", "local", "num_tokens", "expected"),
    [
        (0, 0, 20, 0),  # nothing held
        (12, 0, 20, 12),  # three whole blocks
        (12, 8, 20, 4),  # vLLM already has two of them
        (20, 0, 20, 19),  # all 20 tokens held: the last one is still computed
        (20, 0, 21, 20),
        (8, 12, 20, 0),  # vLLM's own hit is longer than ours
        (14, 0, 20, 14),  # three whole blocks and a partial one of two tokens
        (14, 8, 14, 5),  # the prompt is the held history: all but its last token
    ],
)
def test_external_tokens(held: int, local: int, num_tokens: int, expected: int) -> None:
    assert external_tokens(held, local, num_tokens) == expected


def test_a_resumed_turn_loads_then_saves_its_new_blocks() -> None:
    planner = ConnectorPlanner(BS)
    state = planner.track("r1", "acme", "s")
    state.held_keys = KEYS
    tokens = list(range(100, 114))  # 14 tokens: 3 full blocks held + 2 new tokens... then more
    assert planner.matched(state, local_tokens=4, num_tokens=len(tokens)) == 8
    assert planner.allocated("r1", [10, 11, 12, 13], external=8, prompt_tokens=14) == {
        "engine_cache": 4,
        "symphony": 8,
        "computed": 2,
    }
    plan = planner.step(new=[("r1", [10, 11, 12, 13])], cached=[], computed_after={"r1": 14}, tokens_of={"r1": tokens})
    assert plan.loads == [LoadSpec("acme", "s", 1, (11, 12), b"k2")]
    assert plan.saves == []  # blocks 0-2 are the store's already; 14 tokens fill no new block
    # Two decode steps later the fourth block is full: saved once, with the tokens that key it.
    tokens += [7, 8]
    plan = planner.step(new=[], cached=[("r1", None, False)], computed_after={"r1": 16}, tokens_of={"r1": tokens})
    assert plan.loads == []
    assert plan.saves == [SaveSpec("acme", "s", 3, (13,), tuple(tokens))]
    plan = planner.step(new=[], cached=[("r1", [14], False)], computed_after={"r1": 17}, tokens_of={"r1": [*tokens, 9]})
    assert plan.saves == []


def test_a_resumed_preempted_request_replaces_its_block_list() -> None:
    planner = ConnectorPlanner(BS)
    state = planner.track("r1", "acme", "s")
    state.held_keys = ()
    planner.matched(state, 0, 9)
    assert planner.allocated("r1", [1, 2, 3], external=0, prompt_tokens=9) == {
        "engine_cache": 0,
        "symphony": 0,
        "computed": 9,
    }
    tokens = list(range(9))
    plan = planner.step(new=[("r1", [1, 2, 3])], cached=[], computed_after={"r1": 8}, tokens_of={"r1": tokens})
    assert plan.saves == [SaveSpec("acme", "s", 0, (1, 2), tuple(tokens[:8]))]
    planner.step(new=[], cached=[("r1", [7, 8, 9], True)], computed_after={"r1": 9}, tokens_of={"r1": tokens})
    assert planner.requests["r1"].block_ids == [7, 8, 9]
    # Admitted again after preemption: its prompt's sources were counted the first time.
    assert planner.allocated("r1", [7, 8, 9], external=0, prompt_tokens=9) is None


def test_a_warm_up_loads_its_history_and_saves_and_counts_nothing() -> None:
    planner = ConnectorPlanner(BS)
    state = planner.track("w1", "acme", "s", warmup=True)
    state.held_keys = KEYS
    tokens = list(range(13))  # three whole blocks and the one token more a warm-up sends
    assert planner.matched(state, local_tokens=0, num_tokens=len(tokens)) == 12
    assert planner.allocated("w1", [5, 6, 7, 8], external=12, prompt_tokens=13) is None
    plan = planner.step(new=[("w1", [5, 6, 7, 8])], cached=[], computed_after={"w1": 13}, tokens_of={"w1": tokens})
    assert plan.loads == [LoadSpec("acme", "s", 0, (5, 6, 7), b"k2")]
    tokens += [1, 2, 3]  # had it run on, its new full block would still not be saved
    plan = planner.step(new=[], cached=[("w1", None, False)], computed_after={"w1": 16}, tokens_of={"w1": tokens})
    assert plan.saves == []


def test_requests_are_bounded_and_forgotten_when_finished() -> None:
    planner = ConnectorPlanner(BS, max_requests=2)
    for request_id in ("a", "b", "c"):
        planner.track(request_id, "acme", request_id)
    assert list(planner.requests) == ["b", "c"]
    planner.finished("b")
    assert list(planner.requests) == ["c"]


def test_a_turn_that_ends_mid_block_saves_its_tail_in_the_next_step() -> None:
    planner = ConnectorPlanner(BS)
    state = planner.track("r1", "acme", "s")
    state.held_keys = ()
    planner.matched(state, 0, 6)
    planner.allocated("r1", [1, 2], external=0, prompt_tokens=6)
    tokens = list(range(6))
    plan = planner.step(new=[("r1", [1, 2])], cached=[], computed_after={"r1": 6}, tokens_of={"r1": tokens})
    assert plan.saves == [SaveSpec("acme", "s", 0, (1,), tuple(tokens[:4]))]
    # Two tokens generated; the last one has no KV yet, so 7 of the 8 tokens are computed.
    tokens += [50, 51]
    plan = planner.step(new=[], cached=[("r1", None, False)], computed_after={"r1": 7}, tokens_of={"r1": tokens})
    assert plan.saves == [] and plan.tail_saves == []
    assert planner.finished("r1", computed_tokens=7, token_ids=tokens, block_ids=[1, 2]) is True
    assert "r1" not in planner.requests
    plan = planner.step(new=[], cached=[], computed_after={}, tokens_of={})
    assert plan.tail_saves == [TailSave("r1", SaveSpec("acme", "s", 1, (2,), tuple(tokens[:7])))]
    assert planner.step(new=[], cached=[], computed_after={}, tokens_of={}).tail_saves == []  # once


@pytest.mark.parametrize("case", ["aligned", "warmup", "tiers_off", "unsaved_blocks", "no_block", "tail_held"])
def test_no_tail_save_where_there_is_nothing_to_keep(case: str) -> None:
    planner = ConnectorPlanner(BS)
    state = planner.track("r1", "acme", "s", warmup=case == "warmup", tiers=case != "tiers_off")
    state.held_keys = (b"k0", b"t1") if case == "tail_held" else ()
    state.held_tail = 3 if case == "tail_held" else 0
    planner.matched(state, 0, 7)
    tokens = list(range(9))
    if case != "unsaved_blocks":
        planner.step(new=[("r1", [1, 2, 3])], cached=[], computed_after={"r1": 7}, tokens_of={"r1": tokens})
    computed = 8 if case == "aligned" else 7
    block_ids = [1] if case == "no_block" else [1, 2, 3]
    assert planner.finished("r1", computed_tokens=computed, token_ids=tokens, block_ids=block_ids) is False
    assert planner.step(new=[], cached=[], computed_after={}, tokens_of={}).tail_saves == []


def test_a_held_tail_is_loaded_by_its_key_and_its_block_saved_once_full() -> None:
    planner = ConnectorPlanner(BS)
    state = planner.track("r2", "acme", "s")
    state.held_keys = (*KEYS, b"t3")  # three full blocks and a partial fourth of 2 tokens
    state.held_tail = 2
    tokens = list(range(100, 118))  # 18 tokens: the fourth block's last 2 are new
    assert planner.matched(state, local_tokens=4, num_tokens=len(tokens)) == 10
    assert planner.allocated("r2", [10, 11, 12, 13, 14], external=10, prompt_tokens=18) == {
        "engine_cache": 4,
        "symphony": 10,
        "computed": 4,
    }
    plan = planner.step(
        new=[("r2", [10, 11, 12, 13, 14])], cached=[], computed_after={"r2": 18}, tokens_of={"r2": tokens}
    )
    assert plan.loads == [LoadSpec("acme", "s", 1, (11, 12), b"k2"), LoadSpec("acme", "s", 3, (13,), b"t3", 2)]
    # The partial page filled the fourth block's first half; now it is full and saved as a full block.
    assert plan.saves == [SaveSpec("acme", "s", 3, (13,), tuple(tokens[:16]))]


def test_a_prompt_that_ends_inside_the_held_tail_loads_all_but_its_last_token() -> None:
    planner = ConnectorPlanner(BS)
    state = planner.track("r3", "acme", "s")
    state.held_keys = (*KEYS, b"t3")
    state.held_tail = 3
    assert planner.matched(state, local_tokens=0, num_tokens=14) == 13
    planner.allocated("r3", [1, 2, 3, 4], external=13, prompt_tokens=14)
    plan = planner.step(
        new=[("r3", [1, 2, 3, 4])], cached=[], computed_after={"r3": 14}, tokens_of={"r3": list(range(14))}
    )
    assert plan.loads == [LoadSpec("acme", "s", 0, (1, 2, 3), b"k2"), LoadSpec("acme", "s", 3, (4,), b"t3", 3)]
