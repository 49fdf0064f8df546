"""node_manager.engine_event_keys: vLLM's KV event batches, encoded by vLLM's own classes, translated
to Symphony's chained block keys."""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from vllm.distributed import kv_events as vllm_events
from vllm.v1.core.kv_cache_utils import to_event_extra_keys

from node_manager import engine_event_keys as ours
from node_manager.engine_event_keys import CLEARED, REMOVED, STORED, EngineEventKeys, TenantSalts
from node_manager.kv.store import TieredStore
from symphony.kv_addressing import BlockKey, chain_block_keys
from symphony.tenancy import engine_cache_salt
from tests.helpers import OTHER_MODEL, TEST_MODEL
from tests.unit.kv_store_support import MakeStore

BS = 32
_ENCODER = msgspec.msgpack.Encoder()  # what vLLM's ZmqEventPublisher encodes with
_hash_ids = itertools.count()


def vllm_hash() -> bytes:
    """A vLLM block hash: opaque 32 bytes to the translation."""
    return hashlib.sha256(b"vllm-block-%d" % next(_hash_ids)).digest()


def salt_keys(salt: str | None, blocks: int) -> list[tuple[object, ...] | None] | None:
    """A BlockStored's extra_keys as vLLM publishes them: the salt on the first block only."""
    per_block = [(("cache_salt", salt),) if salt and i == 0 else None for i in range(blocks)]
    return to_event_extra_keys(per_block)


def stored(
    hashes: Sequence[bytes | int],
    tokens: Sequence[int],
    parent: bytes | int | None = None,
    salt: str | None = None,
    *,
    block_size: int = BS,
    medium: str = vllm_events.MEDIUM_GPU,
    lora_name: str | None = None,
    extra_keys: list[tuple[object, ...] | None] | None = None,
    group_idx: int = 0,
) -> vllm_events.BlockStored:
    return vllm_events.BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra_keys if extra_keys is not None else salt_keys(salt, len(hashes)),
        group_idx=group_idx,
    )


def removed(hashes: Sequence[bytes | int], medium: str = vllm_events.MEDIUM_GPU) -> vllm_events.BlockRemoved:
    return vllm_events.BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=0)


def payload(*events: vllm_events.KVCacheEvent) -> bytes:
    return _ENCODER.encode(vllm_events.KVEventBatch(ts=1.0, events=list(events), data_parallel_rank=0))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[BlockKey]]] = []

    def __call__(self, kind: str, keys: Sequence[BlockKey]) -> None:
        assert kind == CLEARED or keys, "no emit without keys, but for cleared"
        assert all(len(key) == 32 for key in keys)
        self.calls.append((kind, list(keys)))

    def keys(self, kind: str) -> list[BlockKey]:
        return [key for k, keys in self.calls if k == kind for key in keys]


class Counts:
    def __init__(self) -> None:
        self.c: Counter[str] = Counter()

    def dropped(self, reason: str, blocks: int) -> None:
        self.c[f"dropped:{reason}"] += blocks

    def lost(self, reason: str) -> None:
        self.c[f"lost:{reason}"] += 1

    def forgotten(self, blocks: int) -> None:
        self.c["forgotten"] += blocks


class Source:
    """A TenantSource: the tenants of a node's registered sessions."""

    def __init__(self, *tenants: str) -> None:
        self.names = list(tenants)
        self.generation = 0
        self.reads = 0

    def add(self, tenant: str) -> None:
        self.names.append(tenant)
        self.generation += 1

    def tenant_generation(self) -> int:
        return self.generation

    def tenants(self) -> list[str]:
        self.reads += 1
        return list(self.names)


class Stream:
    """A translator and what it emitted, fed the way the subscriber feeds it."""

    def __init__(self, *tenants: str, max_blocks: int = 1024, source: Source | None = None) -> None:
        self.emitted = Recorder()
        self.counts = Counts()
        self.source = source or Source(*tenants)
        self.keys = EngineEventKeys(TEST_MODEL, BS, TenantSalts(self.source), self.emitted, max_blocks, self.counts)
        self.seq = 0

    def send(self, *events: vllm_events.KVCacheEvent) -> None:
        self.keys.feed(self.seq, payload(*events))
        self.seq += 1


def tokens(blocks: int, base: int = 1000) -> list[int]:
    return list(range(base, base + blocks * BS))


def chain(tenant: str, token_ids: list[int]) -> list[BlockKey]:
    return list(chain_block_keys(TEST_MODEL, tenant, token_ids, BS).block_keys)


# ---- the wire format -----------------------------------------------------------------------------


def _shape(t: msgspec.inspect.Type) -> object:
    """A field's type with structs named by their tag: ours and vLLM's are other classes."""
    if isinstance(t, msgspec.inspect.StructType):
        return ("struct", t.tag)
    if isinstance(t, msgspec.inspect.ListType):
        return ("list", _shape(t.item_type))
    if isinstance(t, msgspec.inspect.UnionType):
        return ("union", tuple(_shape(member) for member in t.types))
    return t


@pytest.mark.parametrize(
    ("mine", "vllms"),
    [
        (ours.BlockStored, vllm_events.BlockStored),
        (ours.BlockRemoved, vllm_events.BlockRemoved),
        (ours.AllBlocksCleared, vllm_events.AllBlocksCleared),
        (ours.KVEventBatch, vllm_events.KVEventBatch),
    ],
)
def test_the_mirrored_wire_structs_are_vllms(mine: type[msgspec.Struct], vllms: type[msgspec.Struct]) -> None:
    info, theirs = msgspec.inspect.type_info(mine), msgspec.inspect.type_info(vllms)
    assert isinstance(info, msgspec.inspect.StructType) and isinstance(theirs, msgspec.inspect.StructType)
    assert (info.tag_field, info.tag, info.array_like) == (theirs.tag_field, theirs.tag, theirs.array_like)
    their_fields = {f.name: f for f in theirs.fields}
    for index, field in enumerate(info.fields):
        assert field.name in their_fields, f"vLLM's {vllms.__name__} has no field {field.name}"
        assert _shape(field.type) == _shape(their_fields[field.name].type), field.name
        if info.array_like:  # positional: the same place
            assert theirs.fields[index].name == field.name


def test_a_batch_vllm_encodes_decodes_field_for_field() -> None:
    h0, h1 = vllm_hash(), vllm_hash()
    salt = engine_cache_salt("acme")
    event = stored([h0, h1], tokens(2), salt=salt)
    decoded = msgspec.msgpack.decode(
        payload(event, removed([h0]), vllm_events.AllBlocksCleared()), type=ours.KVEventBatch
    )
    first, second, third = decoded.events
    assert isinstance(first, ours.BlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == ([h0, h1], None, tokens(2))
    assert (first.block_size, first.medium, first.lora_name, first.group_idx) == (BS, "GPU", None, 0)
    assert first.extra_keys == [(salt,), None]  # vLLM publishes the salt bare, on the first block only
    assert isinstance(second, ours.BlockRemoved) and second.block_hashes == [h0]
    assert isinstance(third, ours.AllBlocksCleared)


# ---- translation ---------------------------------------------------------------------------------


def test_a_chain_across_batches_gets_the_tenants_block_keys() -> None:
    stream = Stream("acme")
    history = tokens(4)
    h = [vllm_hash() for _ in range(4)]
    stream.send(stored(h[:2], history[: 2 * BS], salt=engine_cache_salt("acme")))  # a prompt's two blocks
    stream.send(stored(h[2:3], history[2 * BS : 3 * BS], parent=h[1]))  # filled while decoding
    stream.send(stored(h[3:], history[3 * BS :], parent=h[2]))
    assert stream.emitted.calls == [
        (STORED, chain("acme", history)[:2]),
        *[(STORED, [k]) for k in chain("acme", history)[2:]],
    ]
    assert stream.keys.live_blocks == 4
    assert stream.counts.c == Counter()


def test_the_64_bit_hashes_vllm_publishes_by_default_chain_and_remove_alike() -> None:
    stream = Stream("acme")  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, vLLM 0.32's default
    history = tokens(2)
    h0, h1 = (int.from_bytes(vllm_hash()[:8], "big") for _ in range(2))
    stream.send(stored([h0], history[:BS], salt=engine_cache_salt("acme")))
    stream.send(stored([h1], history[BS:], parent=h0))
    stream.send(removed([h1]))
    keys = chain("acme", history)
    assert stream.emitted.calls == [(STORED, keys[:1]), (STORED, keys[1:]), (REMOVED, keys[1:])]


def test_one_stored_event_of_several_blocks_chains_each_from_the_one_before() -> None:
    stream = Stream("acme", "globex")
    history = tokens(3)
    stream.send(stored([vllm_hash() for _ in range(3)], history, salt=engine_cache_salt("globex")))
    assert stream.emitted.keys(STORED) == chain("globex", history)
    assert chain("globex", history) != chain("acme", history)  # the tenant roots the chain


def test_the_model_fingerprint_roots_the_chain() -> None:
    history = tokens(1)
    event = stored([vllm_hash()], history, salt=engine_cache_salt("acme"))
    other = Recorder()
    EngineEventKeys(OTHER_MODEL, BS, TenantSalts(Source("acme")), other, 16).feed(0, payload(event))
    same = Stream("acme")
    same.send(event)
    assert other.keys(STORED) != same.emitted.keys(STORED) == chain("acme", history)


def test_the_default_tenant_is_always_known() -> None:
    stream = Stream()
    stream.send(stored([vllm_hash()], tokens(1), salt=engine_cache_salt("default")))
    assert stream.emitted.keys(STORED) == chain("default", tokens(1))


@pytest.mark.parametrize(
    "salt",
    [engine_cache_salt("initech"), engine_cache_salt("acme", "clients-own-salt"), "chosen-by-a-client"],
    ids=["unseen-tenant", "client-salted", "raw"],
)
def test_blocks_of_an_unknown_salt_and_their_children_are_dropped_and_counted(salt: str) -> None:
    stream = Stream("acme")
    h0, h1 = vllm_hash(), vllm_hash()
    stream.send(stored([h0], tokens(1), salt=salt))
    stream.send(stored([h1], tokens(1, base=5000), parent=h0))
    stream.send(removed([h0, h1]))
    assert stream.emitted.calls == []
    assert stream.counts.c == Counter({"dropped:unknown_salt": 1, "dropped:unknown_parent": 1})


def test_a_prompt_sent_without_a_salt_is_dropped() -> None:
    stream = Stream("acme")
    stream.send(stored([vllm_hash(), vllm_hash()], tokens(2), salt=None))
    assert stream.emitted.calls == []
    assert stream.counts.c == Counter({"dropped:no_salt": 2})


def test_a_tenant_registered_later_is_learned_when_its_salt_first_comes() -> None:
    source = Source("acme")
    stream = Stream(source=source)
    stream.send(stored([vllm_hash()], tokens(1), salt=engine_cache_salt("initech")))
    assert stream.counts.c["dropped:unknown_salt"] == 1
    reads = source.reads
    stream.send(stored([vllm_hash()], tokens(1), salt=engine_cache_salt("initech")))
    assert source.reads == reads  # nothing new in the source: not read again
    source.add("initech")
    stream.send(stored([vllm_hash()], tokens(1), salt=engine_cache_salt("initech")))
    assert stream.emitted.keys(STORED) == chain("initech", tokens(1))


def test_tenants_come_from_the_sessions_the_store_registers(make_store: MakeStore) -> None:
    store: TieredStore = make_store()
    emitted = Recorder()
    keys = EngineEventKeys(TEST_MODEL, BS, TenantSalts(store.sessions), emitted, 64)
    salt = engine_cache_salt("hooli")
    keys.feed(0, payload(stored([vllm_hash()], tokens(1), salt=salt)))
    assert emitted.calls == []
    store.sessions.put("hooli", "s1", tokens(2))
    keys.feed(1, payload(stored([vllm_hash()], tokens(1), salt=salt)))
    assert emitted.keys(STORED) == chain("hooli", tokens(1))


def test_bounded_salts_forget_the_least_recently_used_tenant() -> None:
    salts = TenantSalts(None, always=["default"], max_tenants=2)
    for tenant in ("a", "b"):
        salts.learn(tenant)
    assert salts.tenant_of(engine_cache_salt("a")) == "a"  # a is now the more recent
    salts.learn("c")
    assert salts.tenant_of(engine_cache_salt("b")) is None
    assert salts.tenant_of(engine_cache_salt("a")) == "a"
    assert salts.tenant_of(engine_cache_salt("c")) == "c"
    assert salts.tenant_of(engine_cache_salt("default")) == "default"  # kept whatever the bound


def test_salts_keyed_by_the_cluster_secret_are_told_apart_only_with_it() -> None:
    key = b"cluster-secret-0123456789"
    salts = TenantSalts(None, always=["default"], key=key)
    salts.learn("acme")
    assert salts.tenant_of(engine_cache_salt("acme", key=key)) == "acme"
    assert salts.tenant_of(engine_cache_salt("default", key=key)) == "default"
    assert salts.tenant_of(engine_cache_salt("acme")) is None  # the public digest names no one


def test_removed_blocks_are_reported_by_their_keys() -> None:
    stream = Stream("acme")
    h = [vllm_hash() for _ in range(3)]
    stream.send(stored(h, tokens(3), salt=engine_cache_salt("acme")))
    stream.send(removed([h[2], h[1]]), removed([vllm_hash()]))  # the last: never stored here
    keys = chain("acme", tokens(3))
    assert stream.emitted.calls[-1] == (REMOVED, [keys[2], keys[1]])
    assert stream.keys.live_blocks == 1


def test_a_hash_cached_twice_is_removed_with_its_last_copy() -> None:
    stream = Stream("acme")
    h = vllm_hash()
    salt = engine_cache_salt("acme")
    stream.send(stored([h], tokens(1), salt=salt), stored([h], tokens(1), salt=salt))  # two requests, one step
    assert stream.emitted.calls == [(STORED, chain("acme", tokens(1)))]
    stream.send(removed([h]))
    assert stream.emitted.keys(REMOVED) == []
    stream.send(removed([h]))
    assert stream.emitted.keys(REMOVED) == chain("acme", tokens(1))


def test_one_batch_emits_its_events_in_order_one_call_per_run_of_a_kind() -> None:
    stream = Stream("acme")
    a, b, c = vllm_hash(), vllm_hash(), vllm_hash()
    salt = engine_cache_salt("acme")
    stream.send(
        stored([a], tokens(1), salt=salt),
        stored([b], tokens(1, base=7000), salt=salt),
        removed([a]),
        stored([c], tokens(1, base=9000), salt=salt),
    )
    ka, kb, kc = (chain("acme", tokens(1, base))[0] for base in (1000, 7000, 9000))
    assert stream.emitted.calls == [(STORED, [ka, kb]), (REMOVED, [ka]), (STORED, [kc])]


def test_all_blocks_cleared_forgets_every_block() -> None:
    stream = Stream("acme")
    h0, h1 = vllm_hash(), vllm_hash()
    stream.send(stored([h0], tokens(1), salt=engine_cache_salt("acme")))
    stream.send(vllm_events.AllBlocksCleared())
    assert stream.emitted.calls[-1] == (CLEARED, [])
    assert stream.keys.live_blocks == 0
    stream.send(removed([h0]), stored([h1], tokens(1, base=3000), parent=h0))
    assert stream.emitted.calls[-1] == (CLEARED, [])  # nothing of the old cache is reported again
    assert stream.counts.c == Counter({"lost:all_blocks_cleared": 1, "dropped:unknown_parent": 1})


def test_a_gap_in_the_sequence_clears_before_the_batch_after_it() -> None:
    stream = Stream("acme")
    h0, h1 = vllm_hash(), vllm_hash()
    stream.send(stored([h0], tokens(1), salt=engine_cache_salt("acme")))
    stream.seq += 1  # batch 1 lost
    stream.send(stored([h1], tokens(1, base=4000), salt=engine_cache_salt("acme")))
    assert stream.emitted.calls[1:] == [(CLEARED, []), (STORED, chain("acme", tokens(1, base=4000)))]
    assert stream.counts.c == Counter({"lost:gap": 1})
    assert stream.keys.live_blocks == 1


def test_a_sequence_starting_over_is_a_restarted_engine() -> None:
    stream = Stream("acme")
    stream.send(stored([vllm_hash()], tokens(1), salt=engine_cache_salt("acme")))
    stream.send(stored([vllm_hash()], tokens(1, base=2000), salt=engine_cache_salt("acme")))
    stream.seq = 0
    stream.send(stored([vllm_hash()], tokens(1, base=3000), salt=engine_cache_salt("acme")))
    assert stream.emitted.calls[-2:] == [(CLEARED, []), (STORED, chain("acme", tokens(1, base=3000)))]
    assert stream.counts.c == Counter({"lost:restart": 1})


def test_reset_clears_and_expects_a_new_engines_first_batch() -> None:
    stream = Stream("acme")
    stream.send(stored([vllm_hash()], tokens(1), salt=engine_cache_salt("acme")))
    stream.keys.reset("engine_restart")
    assert stream.emitted.calls[-1] == (CLEARED, [])
    stream.seq = 0
    stream.send(stored([vllm_hash()], tokens(1, base=2000), salt=engine_cache_salt("acme")))
    assert stream.emitted.calls[-1] == (STORED, chain("acme", tokens(1, base=2000)))
    assert stream.counts.c == Counter({"lost:engine_restart": 1})  # seq 0 after a reset is no gap


def test_an_undecodable_batch_is_lost_events() -> None:
    stream = Stream("acme")
    stream.send(stored([vllm_hash()], tokens(1), salt=engine_cache_salt("acme")))
    stream.keys.feed(1, b"\xc1 not msgpack")
    assert stream.emitted.calls[-1] == (CLEARED, [])
    assert stream.counts.c == Counter({"lost:undecodable": 1})
    assert stream.keys.live_blocks == 0


def test_the_map_is_bounded_and_a_forgotten_block_is_reported_removed() -> None:
    stream = Stream("acme", max_blocks=4)
    history = tokens(6)
    h = [vllm_hash() for _ in range(6)]
    stream.send(stored(h[:3], history[: 3 * BS], salt=engine_cache_salt("acme")))
    stream.send(stored(h[3:], history[3 * BS :], parent=h[2]))
    keys = chain("acme", history)
    assert stream.keys.live_blocks == 4
    assert stream.emitted.keys(STORED) == keys
    assert stream.emitted.keys(REMOVED) == keys[:2]  # the least recently used
    assert stream.counts.c == Counter({"forgotten": 2})
    stream.send(removed(h[:2]))  # vLLM evicts them later: already reported
    assert stream.emitted.keys(REMOVED) == keys[:2]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"medium": vllm_events.MEDIUM_CPU}, "other_medium"),
        ({"medium": vllm_events.MEDIUM_STORAGE}, "other_medium"),
        ({"block_size": 64}, "block_size"),
        ({"group_idx": 1}, "other_group"),
        ({"lora_name": "adapter"}, "lora"),
        ({"extra_keys": [("adapter", "salt"), None]}, "extra_keys"),
    ],
)
def test_blocks_symphony_does_not_key_this_way_are_dropped(change: dict[str, Any], reason: str) -> None:
    stream = Stream("acme")
    block_size = change.get("block_size", BS)
    stream.send(
        stored([vllm_hash(), vllm_hash()], list(range(2 * block_size)), salt=engine_cache_salt("acme"), **change)
    )
    assert stream.emitted.calls == []
    assert stream.counts.c == Counter({f"dropped:{reason}": 2})


def test_removals_from_other_media_leave_the_engines_blocks_alone() -> None:
    stream = Stream("acme")
    h = vllm_hash()
    stream.send(stored([h], tokens(1), salt=engine_cache_salt("acme")))
    stream.send(removed([h], medium=vllm_events.MEDIUM_CPU))  # an offloading tier's copy went
    assert stream.emitted.keys(REMOVED) == []
    assert stream.keys.live_blocks == 1


def test_a_block_with_extra_keys_past_the_first_ends_the_translated_chain() -> None:
    stream = Stream("acme")
    salt = engine_cache_salt("acme")
    mm = to_event_extra_keys([(("cache_salt", salt),), (("mm", "image-0", 0),), None])
    stream.send(stored([vllm_hash() for _ in range(3)], tokens(3), extra_keys=mm))
    assert stream.emitted.keys(STORED) == chain("acme", tokens(3))[:1]
    assert stream.counts.c == Counter({"dropped:extra_keys": 2})


def test_a_stored_event_whose_tokens_are_not_its_blocks_is_dropped() -> None:
    stream = Stream("acme")
    stream.send(stored([vllm_hash(), vllm_hash()], tokens(1), salt=engine_cache_salt("acme")))
    assert stream.emitted.calls == []
    assert stream.counts.c == Counter({"dropped:malformed": 2})
