"""symphony.kv_addressing: deterministic, model- and tenant-namespaced, chained block keys."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from symphony.kv_addressing import (
    BLOCK_KEY_BYTES,
    ModelFingerprint,
    SessionBlocks,
    block_key,
    chain_block_keys,
    tail_key,
    tail_length,
    tail_mark,
    tail_mark_of,
    tenant_root,
    token_array,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelFingerprint(bytes(range(32)))
OTHER = ModelFingerprint(bytes(range(1, 33)))
TOKENS = [101, 7, 65535, 0, 2**32 - 1, 42, 42, 42, 9, 8, 7, 6, 5]  # 3 full blocks of 4 + a 1-token tail


def _hand_chain(model: bytes, tenant: str, tokens: list[int], block_size: int) -> list[bytes]:
    """The documented rule, written out independently of the module."""
    parent = hashlib.sha256(
        b"symphony-kv-block-key-v2" + b"\x00model\x00" + model + b"\x00tenant\x00" + tenant.encode()
    ).digest()
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(block)}I", *block)).digest()
        keys.append(parent)
    return keys


def test_golden_value_matches_the_documented_rule() -> None:
    blocks = chain_block_keys(MODEL, "acme", TOKENS, 4)
    assert list(blocks.block_keys) == _hand_chain(MODEL, "acme", TOKENS, 4)
    assert (
        tenant_root(MODEL, "acme")
        == hashlib.sha256(b"symphony-kv-block-key-v2\x00model\x00" + MODEL + b"\x00tenant\x00acme").digest()
    )
    # A literal pin, so a change of seed or rule that also changed the helper above is still caught.
    assert chain_block_keys(MODEL, "acme", [1, 2, 3, 4], 4).block_keys[0].hex() == (
        "92d8ab3fa8c4c2307f43cea16339c1bc306d231cc73dac03add779e725c9af39"
    )
    assert (
        block_key(tenant_root(MODEL, "t"), [1, 2])
        == hashlib.sha256(tenant_root(MODEL, "t") + b"\x01\x00\x00\x00\x02\x00\x00\x00").digest()
    )


def test_keys_are_32_byte_digests_and_deterministic() -> None:
    first = chain_block_keys(MODEL, "acme", TOKENS, 4)
    second = chain_block_keys(MODEL, "acme", list(TOKENS), 4)
    assert first == second
    assert first.num_blocks == 3
    assert all(isinstance(k, bytes) and len(k) == BLOCK_KEY_BYTES for k in first.block_keys)
    assert len(set(first.block_keys)) == 3


def test_same_keys_in_another_process_with_another_hash_seed() -> None:
    script = (
        "from symphony.kv_addressing import chain_block_keys\n"
        f"blocks = chain_block_keys(bytes(range(32)), 'acme', {TOKENS!r}, 4)\n"
        "print(' '.join(k.hex() for k in blocks.block_keys))\n"
        "print(hash('acme'))\n"
    )
    outputs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        outputs.append(done.stdout.split("\n"))
    here = [k.hex() for k in chain_block_keys(MODEL, "acme", TOKENS, 4).block_keys]
    assert outputs[0][1] != outputs[1][1], "the two processes should really have different str hashes"
    assert outputs[0][0].split() == here
    assert outputs[1][0].split() == here


def test_tenants_are_namespaced() -> None:
    a = chain_block_keys(MODEL, "tenant-a", TOKENS, 4)
    b = chain_block_keys(MODEL, "tenant-b", TOKENS, 4)
    assert tenant_root(MODEL, "tenant-a") != tenant_root(MODEL, "tenant-b")
    assert set(a.block_keys).isdisjoint(b.block_keys)
    # Not fooled by concatenation tricks either.
    assert tenant_root(MODEL, "ab") != tenant_root(MODEL, "a")


def test_models_are_namespaced() -> None:
    """The same tokens of the same tenant under another model (dtype, weights, layout) share no key,
    so no store can hand one model's pages to another's lookup."""
    here, there = chain_block_keys(MODEL, "acme", TOKENS, 4), chain_block_keys(OTHER, "acme", TOKENS, 4)
    assert set(here.block_keys).isdisjoint(there.block_keys)
    assert tail_key(tenant_root(MODEL, "acme"), [1]) != tail_key(tenant_root(OTHER, "acme"), [1])
    # An incremental start computed under another model is not reused.
    assert chain_block_keys(OTHER, "acme", TOKENS, 4, start=chain_block_keys(MODEL, "acme", TOKENS[:8], 4)) == there
    with pytest.raises(ValueError, match="32 bytes"):
        tenant_root(ModelFingerprint(b"short"), "acme")


def test_changing_a_token_in_block_zero_changes_every_later_key() -> None:
    base = chain_block_keys(MODEL, "acme", TOKENS, 4)
    edited = list(TOKENS)
    edited[0] += 1
    changed = chain_block_keys(MODEL, "acme", edited, 4)
    assert all(x != y for x, y in zip(base.block_keys, changed.block_keys, strict=True))


def test_changing_a_later_block_keeps_the_prefix_keys() -> None:
    base = chain_block_keys(MODEL, "acme", TOKENS, 4)
    edited = list(TOKENS)
    edited[9] += 1  # block 2
    changed = chain_block_keys(MODEL, "acme", edited, 4)
    assert changed.block_keys[:2] == base.block_keys[:2]
    assert changed.block_keys[2] != base.block_keys[2]


def test_same_block_tokens_at_different_positions_get_different_keys() -> None:
    blocks = chain_block_keys(MODEL, "acme", [5, 5, 5, 5, 5, 5, 5, 5], 4)
    assert blocks.block_keys[0] != blocks.block_keys[1]


@pytest.mark.parametrize(("count", "blocks", "tail"), [(0, 0, 0), (3, 0, 3), (4, 1, 0), (13, 3, 1), (16, 4, 0)])
def test_tail_tokens_are_not_keyed(count: int, blocks: int, tail: int) -> None:
    tokens = list(range(100, 100 + count))
    result = chain_block_keys(MODEL, "acme", tokens, 4)
    assert result.num_blocks == blocks
    assert result.tail_tokens == tuple(tokens[blocks * 4 :])
    assert len(result.tail_tokens) == tail
    assert result.tenant == "acme" and result.block_size == 4


def test_tail_does_not_affect_full_block_keys() -> None:
    assert (
        chain_block_keys(MODEL, "acme", TOKENS[:12], 4).block_keys
        == chain_block_keys(MODEL, "acme", TOKENS, 4).block_keys
    )


def test_a_tail_key_names_its_parent_length_and_tokens_in_its_first_eight_bytes() -> None:
    # The block index keeps a key's first 8 bytes (little-endian): for a tail, its parent's mark in
    # the low 32 bits, 16 bits of the tokens' hash and the length on top (see `tail_key`).
    parent = chain_block_keys(MODEL, "acme", TOKENS, 4).block_keys[1]
    keys = {n: tail_key(parent, TOKENS[8 : 8 + n]) for n in (1, 2, 3)}
    for n, key in keys.items():
        head = int.from_bytes(key[:8], "little")
        assert len(key) == 32 and tail_length(head) == n and tail_mark_of(head) == tail_mark(parent)
    assert len(set(keys.values())) == 3
    other_parent = chain_block_keys(MODEL, "acme", TOKENS, 4).block_keys[0]
    assert tail_mark(other_parent) != tail_mark(parent)
    # Other tokens of the same length: another key, and other fingerprint bits beside the mark.
    changed = tail_key(parent, [*TOKENS[8:10], 77])
    assert changed != keys[3] and changed[:8] != keys[3][:8] and changed[:4] == keys[3][:4]
    # Never a full block's key, though the tokens are those of a block.
    assert tail_key(parent, TOKENS[8:12]) != chain_block_keys(MODEL, "acme", TOKENS, 4).block_keys[2]
    assert tail_key(parent, np.array(TOKENS[8:11], dtype=np.int64)) == keys[3]
    with pytest.raises(ValueError, match="partial block"):
        tail_key(parent, [])


@pytest.mark.parametrize("split", [0, 3, 4, 5, 8, 12, 13])
def test_incremental_start_equals_from_scratch(split: int) -> None:
    longer = [*TOKENS, 1, 2, 3, 4, 5, 6, 7]
    prefix = chain_block_keys(MODEL, "acme", longer[:split], 4)
    assert chain_block_keys(MODEL, "acme", longer, 4, start=prefix) == chain_block_keys(MODEL, "acme", longer, 4)


def test_incremental_start_hashes_only_new_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    import symphony.kv_addressing as addressing

    prefix = chain_block_keys(MODEL, "acme", TOKENS[:8], 4)
    hashed: list[bytes] = []

    def counting_sha256(data: bytes) -> Any:
        hashed.append(bytes(data[32:]))  # what follows the parent key: the block's tokens
        return hashlib.sha256(data)

    expected = chain_block_keys(MODEL, "acme", TOKENS, 4)
    monkeypatch.setattr(addressing, "hashlib", SimpleNamespace(sha256=counting_sha256))
    assert chain_block_keys(MODEL, "acme", TOKENS, 4, start=prefix) == expected
    assert hashed == [array("I", TOKENS[8:12]).tobytes()]


def test_start_from_another_tenant_or_block_size_is_ignored() -> None:
    other_tenant = chain_block_keys(MODEL, "other", TOKENS[:8], 4)
    other_size = chain_block_keys(MODEL, "acme", TOKENS[:8], 2)
    expected = chain_block_keys(MODEL, "acme", TOKENS, 4)
    assert chain_block_keys(MODEL, "acme", TOKENS, 4, start=other_tenant) == expected
    assert chain_block_keys(MODEL, "acme", TOKENS, 4, start=other_size) == expected


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_out_of_range_token_ids_raise_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match="token id"):
        chain_block_keys(MODEL, "acme", [1, 2, bad, 4], 4)


def test_out_of_range_token_in_the_tail_is_also_rejected() -> None:
    with pytest.raises(ValueError):
        chain_block_keys(MODEL, "acme", [1, 2, 3, 4, -5], 4)


def test_largest_token_id_is_accepted() -> None:
    assert chain_block_keys(MODEL, "acme", [2**32 - 1] * 4, 4).num_blocks == 1


@pytest.mark.parametrize("block_size", [0, -4])
def test_non_positive_block_size_raises(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        chain_block_keys(MODEL, "acme", TOKENS, block_size)


def test_session_blocks_is_immutable() -> None:
    blocks = chain_block_keys(MODEL, "acme", TOKENS, 4)
    assert isinstance(blocks, SessionBlocks)
    with pytest.raises(AttributeError):
        blocks.tenant = "other"  # type: ignore[misc]


@pytest.mark.parametrize("dtype", [np.uint32, np.int64, np.uint64])
def test_token_arrays_key_like_lists(dtype: type) -> None:
    array = np.array(TOKENS, dtype=dtype)
    assert chain_block_keys(MODEL, "acme", array, 4) == chain_block_keys(MODEL, "acme", TOKENS, 4)
    start = chain_block_keys(MODEL, "acme", TOKENS[:8], 4)
    assert chain_block_keys(MODEL, "acme", array, 4, start=start) == chain_block_keys(MODEL, "acme", TOKENS, 4)


def test_token_array_is_read_only_and_validated() -> None:
    tokens = token_array(TOKENS)
    assert tokens.tolist() == TOKENS and not tokens.flags.writeable
    assert token_array(tokens) is tokens  # already a token array: no copy
    with pytest.raises(ValueError):
        tokens[0] = 1
    writable = np.array(TOKENS, dtype=np.uint32)
    copied = token_array(writable)
    writable[0] = 5  # the caller's array changing later must not change a stored history
    assert copied[0] == TOKENS[0]
    for bad in (np.array([1, -1]), np.array([2**32]), np.array([1.5]), np.zeros((2, 2), np.uint32)):
        with pytest.raises(ValueError):
            token_array(bad)
    with pytest.raises(OverflowError):
        token_array([1, -1])
