"""The KV locator: a request's block keys (incremental per session) and, per node, the prefix the
cluster KV index holds, or the session table's hint where the index is not current."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scheduler.kv_index import BlockBatch, BlockEvent, ClusterKVIndex, EventKind, IndexTier, NodePrefix
from scheduler.kv_locator import NOT_LOCATED, KVLocator, donor_copies, held_from_index, with_pending
from scheduler.routing import HeldPrefix, RouteRequest
from symphony.kv_addressing import ModelFingerprint, chain_block_keys, token_array
from tests.helpers import OTHER_MODEL, TEST_MODEL

BLOCK = 4
MODEL = ModelFingerprint(TEST_MODEL)


def ids(n: int, seed: int = 0) -> np.ndarray:
    return token_array([(seed * 7919 + i) % 50_000 for i in range(n)])


class Index:
    """A real ClusterKVIndex with nodes that apply one snapshot each."""

    def __init__(self, *nodes: str) -> None:
        self.index = ClusterKVIndex(10_000, 4)
        self.synced: set[str] = set()
        for node in nodes:
            self.index.add_node(node)

    def holds(self, node: str, tier: IndexTier, keys: list[bytes]) -> None:
        event = BlockEvent(EventKind.STORED, tier, b"".join(keys))
        self.index.apply(node, BlockBatch(f"e-{node}", 1, (event,), True, True), now_s=1.0, now_unix_ms=1000)
        self.synced.add(node)

    def locator(self, max_sessions: int = 16) -> KVLocator:
        return KVLocator(self.index.prefix, lambda node: node in self.synced, max_sessions)


def test_block_keys_are_the_stores_and_a_next_turn_hashes_only_its_new_blocks() -> None:
    locator = Index().locator()
    first = ids(10 * BLOCK + 3)
    keys = locator.block_keys("acme", "s1", first, MODEL, BLOCK)
    assert keys == list(chain_block_keys(MODEL, "acme", first, BLOCK).block_keys)
    assert locator.keys_hashed == 10
    longer = token_array([*first.tolist(), *range(9)])  # the turn's answer and question: 12 tokens on
    keys = locator.block_keys("acme", "s1", longer, MODEL, BLOCK)
    assert keys == list(chain_block_keys(MODEL, "acme", longer, BLOCK).block_keys)
    assert locator.keys_hashed == 10 + 3  # blocks 10, 11 and 12 (block 10 was partial before)


def test_an_edited_history_is_hashed_again_from_the_edit_and_sessions_are_bounded() -> None:
    locator = Index().locator(max_sessions=2)
    tokens = ids(8 * BLOCK)
    locator.block_keys("acme", "s1", tokens, MODEL, BLOCK)
    edited = tokens.copy()
    edited[5 * BLOCK + 1] += 1
    keys = locator.block_keys("acme", "s1", token_array(edited), MODEL, BLOCK)
    assert keys == list(chain_block_keys(MODEL, "acme", edited, BLOCK).block_keys)
    assert locator.keys_hashed == 8 + 3
    locator.block_keys("acme", "s2", tokens, MODEL, BLOCK)
    locator.block_keys("acme", "s3", tokens, MODEL, BLOCK)
    assert len(locator) == 2
    before = locator.keys_hashed
    locator.block_keys("acme", "s1", token_array(edited), MODEL, BLOCK)  # s1 was the oldest: dropped
    assert locator.keys_hashed == before + 8


def test_another_model_or_tenant_never_reuses_a_sessions_keys() -> None:
    locator = Index().locator()
    tokens = ids(6 * BLOCK)
    mine = locator.block_keys("acme", "s1", tokens, MODEL, BLOCK)
    other_model = locator.block_keys("acme", "s1", tokens, ModelFingerprint(OTHER_MODEL), BLOCK)
    assert not set(mine) & set(other_model)
    assert locator.block_keys("globex", "s1", tokens, MODEL, BLOCK) == list(
        chain_block_keys(MODEL, "globex", tokens, BLOCK).block_keys
    )


def test_a_shared_prefix_is_found_for_a_new_session_of_the_tenant_only() -> None:
    index = Index("a", "b")
    system = ids(12 * BLOCK, seed=1)  # a system prompt some session of acme computed on "a"
    index.holds("a", IndexTier.ENGINE, list(chain_block_keys(MODEL, "acme", system, BLOCK).block_keys))
    index.holds("b", IndexTier.DRAM, [])
    question = token_array([*system.tolist(), *ids(5 * BLOCK + 2, seed=2).tolist()])
    locator = index.locator()
    located = locator.locate("acme", "new", question, MODEL, BLOCK, ["a", "b"], {})
    assert located.prompt_tokens == len(question)
    assert located.source == "index"
    assert located.held == {"a": HeldPrefix(engine=12 * BLOCK)}  # "b" holds none: absent
    for tenant, model in (("globex", MODEL), ("acme", ModelFingerprint(OTHER_MODEL))):
        elsewhere = locator.locate(tenant, "new", question, model, BLOCK, ["a", "b"], {})
        assert elsewhere.held == {}


def test_nodes_the_index_is_not_current_for_keep_their_hints_and_stale_hints_are_corrected() -> None:
    index = Index("a", "b")
    tokens = ids(8 * BLOCK)
    index.holds("a", IndexTier.SSD, list(chain_block_keys(MODEL, "acme", tokens, BLOCK).block_keys[:3]))
    # The session table says both nodes ran this session's turns; "a" has since evicted most of it,
    # and "b" streams no events (an older node manager, or a resync under way).
    hints = {"a": 8 * BLOCK, "b": 8 * BLOCK}
    located = index.locator().locate("acme", "s1", tokens, MODEL, BLOCK, ["a", "b"], hints)
    assert located.held == {"a": HeldPrefix(ssd=3 * BLOCK), "b": HeldPrefix(dram=8 * BLOCK)}


def test_a_session_is_in_an_engine_only_with_every_block_of_its_last_prompt_there() -> None:
    index = Index("a", "b", "c", "d")
    prompt = ids(6 * BLOCK + 1)
    keys = list(chain_block_keys(MODEL, "acme", prompt, BLOCK).block_keys)
    index.holds("a", IndexTier.ENGINE, keys)
    index.holds("b", IndexTier.ENGINE, keys[:4])  # its engine evicted the last two blocks
    index.holds("b", IndexTier.DRAM, keys[4:])
    index.holds("c", IndexTier.DRAM, keys)
    index.holds("d", IndexTier.ENGINE, keys[:5])  # all but the last: close enough
    locator = index.locator()
    assert not locator.in_engine(("acme", "s1"), "a"), "no prompt of the session seen yet"
    locator.block_keys("acme", "s1", prompt, MODEL, BLOCK)
    assert [locator.in_engine(("acme", "s1"), n) for n in "abcd"] == [True, False, False, True]
    short = ids(BLOCK + 1, seed=3)  # one full block: that one must be there
    index.holds("c", IndexTier.DRAM, list(chain_block_keys(MODEL, "acme", short, BLOCK).block_keys))
    locator.block_keys("acme", "s2", short, MODEL, BLOCK)
    assert not locator.in_engine(("acme", "s2"), "c")
    assert not locator.in_engine(("globex", "s1"), "a")
    index.synced.discard("a")  # a resync under way: the index is not current for "a"
    assert not locator.in_engine(("acme", "s1"), "a")


def test_without_ids_a_fingerprint_or_a_block_size_nothing_is_located() -> None:
    locator = Index("a").locator()
    assert locator.locate("acme", "s", None, MODEL, BLOCK, ["a"], {"a": 5}) is NOT_LOCATED
    assert locator.locate("acme", "s", ids(8), None, BLOCK, ["a"], {}) is NOT_LOCATED
    assert locator.locate("acme", "s", ids(8), MODEL, 0, ["a"], {}) is NOT_LOCATED


def test_index_answers_convert_to_tokens_by_tier() -> None:
    assert held_from_index(NodePrefix(7, engine=1, hbm=2, dram=3, ssd=1), 32) == HeldPrefix(32, 64, 96, 32)


def test_the_session_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_sessions"):
        KVLocator(lambda keys: {}, lambda node: True, 0)


def test_the_first_session_with_a_shared_prefix_stays_its_donor_until_it_fails_within_the_bound() -> None:
    index = Index("a", "b")
    system = ids(12 * BLOCK, seed=1)
    index.holds("a", IndexTier.DRAM, list(chain_block_keys(MODEL, "acme", system, BLOCK).block_keys))
    index.holds("b", IndexTier.DRAM, [])
    locator = KVLocator(index.index.prefix, lambda node: node in index.synced, 16, max_donor_blocks=40)

    def prompt(seed: int) -> np.ndarray:
        return token_array([*system.tolist(), *ids(5 * BLOCK + 2, seed=seed).tolist()])

    def donor(session: str, seed: int, tenant: str = "acme") -> tuple[str | None, int]:
        located = locator.locate(tenant, session, prompt(seed), MODEL, BLOCK, ["a", "b"], {})
        return located.donor, located.donor_tokens

    assert donor("s1", 2) == (None, 0)  # the first session with the prefix: none before it
    assert donor("s2", 3) == ("s1", 12 * BLOCK)
    assert donor("s3", 4) == ("s1", 12 * BLOCK)  # the first stays (its turn is done; s2's may not be)
    # A session's own earlier prompt is no donor: its copies are the session table's.
    assert donor("s1", 2) == (None, 0)
    assert donor("g1", 5, tenant="globex") == (None, 0)
    # s1's copy could not be pulled: the next request with the prefix replaces it.
    locator.donor_failed("s1")
    assert donor("s4", 6) == (None, 0)
    assert donor("s5", 7) == ("s4", 12 * BLOCK)
    shared = chain_block_keys(MODEL, "acme", system, BLOCK).block_keys[-1]
    locator.set_donor(shared, "s5")  # no node had s4's copy (RequestLocator)
    assert donor("s6", 8) == ("s5", 12 * BLOCK)
    # 12 shared blocks, 5 of each of s1-s6's own and 17 of globex's: 59 over 40. The least recently
    # used went first: s1's, s2's and s3's own and 4 of g1's (the shared ones were used since).
    assert locator.donor_blocks == 40
    assert [locator.donor(key) for key in chain_block_keys(MODEL, "acme", prompt(2), BLOCK).block_keys[11:]] == [
        "s5",
        *[None] * 5,
    ]
    with pytest.raises(ValueError, match="max_donor_blocks"):
        KVLocator(lambda keys: {}, lambda node: True, 1, max_donor_blocks=0)


def test_a_donors_copies_are_bounded_by_the_prefix_and_what_each_node_still_holds() -> None:
    held = {"a": HeldPrefix(engine=96), "b": HeldPrefix(ssd=32)}
    copies = {"a": 200, "b": 200, "c": 200}  # "c" holds none of the prompt now: the copy is gone
    assert donor_copies(held, 64, copies) == {"a": 64, "b": 32}
    assert donor_copies(held, 64, {}) == {}


def test_a_prefix_an_earlier_request_is_computing_counts_on_its_node_but_is_never_pulled() -> None:
    """s1's prompt was routed to "a" and is in prefill: the index holds none of it yet. s2 shares its
    12-block system prompt: located, "a" counts as holding it (in DRAM, where the connector will
    save it), with no donor to pull from. Once the index holds the blocks, the same prefix is a
    donor's to pull and no longer pending."""
    index = Index("a", "b")
    index.holds("a", IndexTier.DRAM, [])
    index.holds("b", IndexTier.DRAM, [])
    system = ids(12 * BLOCK, seed=1)

    def prompt(seed: int) -> np.ndarray:
        return token_array([*system.tolist(), *ids(5 * BLOCK + 2, seed=seed).tolist()])

    locator = index.locator()
    assert locator.locate("acme", "s1", prompt(2), MODEL, BLOCK, ["a", "b"], {}).pending_donor is None
    located = locator.locate("acme", "s2", prompt(3), MODEL, BLOCK, ["a", "b"], {})
    assert (located.pending_donor, located.pending_tokens, located.donor) == ("s1", 12 * BLOCK, None)
    request = RouteRequest("acme", "s2", "m", held=located.held)
    routed = with_pending(request, located, {"a": 17 * BLOCK + 2})  # the session table: s1 sent to "a"
    assert routed.held == {"a": HeldPrefix(dram=12 * BLOCK)}
    assert routed.prefix_copies == {} and routed.prefix_donor is None
    # A node's own longer holding stands; a shorter one is extended, in DRAM after its faster tiers.
    longer = dataclasses.replace(request, held={"a": HeldPrefix(engine=4 * BLOCK)}, prefix_copies={})
    assert with_pending(longer, located, {"a": 40}).held == {"a": HeldPrefix(engine=4 * BLOCK, dram=40 - 4 * BLOCK)}
    assert with_pending(longer, located, {"a": 2 * BLOCK}).held == {"a": HeldPrefix(engine=4 * BLOCK)}
    index.holds("a", IndexTier.DRAM, list(chain_block_keys(MODEL, "acme", system, BLOCK).block_keys))
    done = locator.locate("acme", "s3", prompt(4), MODEL, BLOCK, ["a", "b"], {})
    assert (done.pending_donor, done.donor, done.donor_tokens) == (None, "s1", 12 * BLOCK)
