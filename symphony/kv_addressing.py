"""KV addressing: deterministic chained block keys, namespaced by model and tenant.

A block key is sha256 over (parent key, the block's token ids as little-endian uint32). The chain
starts from a root derived from a fixed seed, the model fingerprint (`symphony.model_identity`) and
the tenant, so every process, on every host and after every restart, computes the same keys for the
same tokens under the same model (LMCache's cross-process hash mismatches came from Python `hash()`
and random seeds; neither is used here). Two tenants never share a key, so prefix sharing, and any
leak through it, stays within a tenant; two models (another dtype, another revision of the weights,
another page layout) never share a key, so no engine is ever handed KV another model computed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

BlockKey = NewType("BlockKey", bytes)  # 32-byte sha256 digest
BLOCK_KEY_BYTES = 32
ModelFingerprint = NewType("ModelFingerprint", bytes)  # 32-byte sha256 digest (`symphony.model_identity`)
FINGERPRINT_BYTES = 32
# v2: roots hang off the model fingerprint as well as the tenant.
_SEED = b"symphony-kv-block-key-v2"
_MAX_TOKEN_ID = 2**32 - 1
_TAIL_MARK = b"\x00partial-tail\x00"
_MAX_TAIL_TOKENS = 0xFFFF  # the top 16 bits of a tail key's fingerprint (`tail_key`)


def tenant_root(model: ModelFingerprint, tenant: str) -> BlockKey:
    """The parent of a tenant's first block under `model`: every chain of that tenant and model
    hangs off it. Raises ValueError for a fingerprint that is not 32 bytes."""
    if len(model) != FINGERPRINT_BYTES:
        raise ValueError(f"a model fingerprint is {FINGERPRINT_BYTES} bytes, got {len(model)}")
    return BlockKey(hashlib.sha256(_SEED + b"\x00model\x00" + model + b"\x00tenant\x00" + tenant.encode()).digest())


def token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The token ids as a read-only little-endian uint32 array: what a stored history keeps, since
    comparing and slicing it run in C (a resumed turn compares its whole history every request).
    Raises ValueError (or OverflowError) for ids outside 0..2**32-1."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError("token ids must be one-dimensional")
        if token_ids.dtype == np.dtype("<u4") and not token_ids.flags.writeable:
            return token_ids  # already one (a view of received bytes, or a stored history)
        if len(token_ids):
            if not np.issubdtype(token_ids.dtype, np.integer):
                raise ValueError(f"token ids must be integers, got {token_ids.dtype}")
            low, high = int(token_ids.min()), int(token_ids.max())
            if low < 0 or high > _MAX_TOKEN_ID:
                raise ValueError(f"token id {low if low < 0 else high} outside 0..{_MAX_TOKEN_ID}")
        tokens = np.array(token_ids, dtype="<u4")
        tokens.flags.writeable = False
        return tokens
    # array() converts a list ~6x faster than numpy does and range-checks every id on the way; the
    # array views immutable bytes, so it is read-only.
    return np.frombuffer(_packed(token_ids), dtype="<u4")


def _packed(token_ids: Sequence[int]) -> bytes:
    tokens = array("I", token_ids)  # raises OverflowError for ids outside uint32
    if tokens.itemsize != 4:  # pragma: no cover - 'I' is 4 bytes on every platform we run on
        raise RuntimeError("array('I') is not 32-bit here")
    if tokens and array("I", [1]).tobytes() != b"\x01\x00\x00\x00":  # pragma: no cover - big-endian host
        tokens.byteswap()
    return tokens.tobytes()


def block_key(parent: BlockKey, token_ids: Sequence[int] | np.ndarray) -> BlockKey:
    data = token_ids.astype("<u4", copy=False).tobytes() if isinstance(token_ids, np.ndarray) else _packed(token_ids)
    return BlockKey(hashlib.sha256(parent + data).digest())


def tail_mark(parent: BlockKey) -> int:
    """What every partial block after the full block `parent` has in the low 32 bits of its key's
    first 8 bytes (`tail_key`): one hash names all of them."""
    return int.from_bytes(_tail_mark_bytes(parent), "little")


def _tail_mark_bytes(parent: BlockKey) -> bytes:
    return hashlib.sha256(parent + _TAIL_MARK).digest()[:4]


def tail_key(parent: BlockKey, token_ids: Sequence[int] | np.ndarray) -> BlockKey:
    """The key of a partial last block (1..block_size - 1 tokens after the full block `parent`).
    Its page holds the KV of those tokens only, so it is keyed apart from any full block: a turn that
    ends mid-block leaves its tail under this key, and the next turn, whose prompt continues the same
    tokens, loads it instead of recomputing up to a block of tokens.

    The next turn's lookup does not know the earlier turn's tail length, and hashing every candidate
    length would cost vLLM's scheduling step too much (docs/design-notes.md#tail-keys). So the key's
    first 8 bytes, which the block
    index keeps (its fingerprint, little-endian), are laid out for that lookup: `tail_mark(parent)`
    in the low 32 bits (every tail after `parent` has the same home slot in an index of fewer than
    2**32 slots), 16 bits of the hash over the tokens, and the token count in the top 16 bits. One
    probe of that home slot lists the lengths held, and one hash of the likeliest confirms it (see
    `BlockIndexReader.run_at_home_of`). The remaining 24 bytes are the hash's. Two tails of one
    parent and length whose tokens differ share that fingerprint with odds 2**-16; a lookup misled
    so names a key the store lacks, its load fails, and vLLM recomputes the block."""
    data = token_ids.astype("<u4", copy=False).tobytes() if isinstance(token_ids, np.ndarray) else _packed(token_ids)
    count = len(data) // 4
    if not 0 < count <= _MAX_TAIL_TOKENS:
        raise ValueError(f"a partial block has 1..{_MAX_TAIL_TOKENS} tokens, got {count}")
    tokens_hash = hashlib.sha256(parent + _TAIL_MARK + data).digest()
    return BlockKey(_tail_mark_bytes(parent) + tokens_hash[4:6] + count.to_bytes(2, "little") + tokens_hash[8:])


def tail_length(fingerprint: int) -> int:
    """The token count of a partial block whose key has this block index fingerprint."""
    return fingerprint >> 48


def tail_mark_of(fingerprint: int) -> int:
    """The `tail_mark` of the parent of a partial block whose key has this block index fingerprint."""
    return fingerprint & 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class SessionBlocks:
    """A session's token history cut into full blocks (keyed) and the partial tail (not stored)."""

    model: ModelFingerprint
    tenant: str
    block_size: int
    block_keys: tuple[BlockKey, ...]
    tail_tokens: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_keys)


def chain_block_keys(
    model: ModelFingerprint,
    tenant: str,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    start: SessionBlocks | None = None,
) -> SessionBlocks:
    """Key every full block of `token_ids`. With `start` (an earlier result for a prefix of the same
    tokens) only the new blocks are hashed, so appending a turn costs what the turn adds."""
    tokens = _checked(token_ids)
    known: tuple[BlockKey, ...] = ()
    if start is not None and start.model == model and start.tenant == tenant and start.block_size == block_size:
        known = start.block_keys
    keys = [*known, *keys_after(model, tenant, tokens, block_size, known)]
    full_blocks = len(tokens) // block_size
    return SessionBlocks(model, tenant, block_size, tuple(keys), tuple(tokens[full_blocks * block_size :].tolist()))


def keys_after(
    model: ModelFingerprint, tenant: str, tokens: np.ndarray, block_size: int, known: Sequence[BlockKey]
) -> Iterator[BlockKey]:
    """The keys of the full blocks of `tokens` (a token array) after the `known` leading ones,
    hashed one at a time as they are asked for: a reader that stops at the first block it does not
    find pays for no more (the connector's lookup of a request's history)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    # One bytes object for all the tokens, hashed through slices of it: the connector keys every new
    # request's prompt on vLLM's scheduling thread (and the scheduler every request it locates), and
    # per-block numpy slices and conversions were half of that cost. The bytes hashed are `block_key`'s.
    data = tokens.tobytes()
    step = 4 * block_size
    parent: bytes = known[-1] if known else tenant_root(model, tenant)
    sha256 = hashlib.sha256
    for offset in range(len(known) * step, len(tokens) // block_size * step, step):
        # One concatenation and a one-shot hash: ~0.3 us less per block than update() on a hash object.
        # Not wrapped in BlockKey (a NewType, whose call costs ~15% of the loop); the digest is one.
        parent = sha256(parent + data[offset : offset + step]).digest()
        yield parent  # type: ignore[misc]


def _checked(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(token_ids, np.ndarray):
        return token_array(token_ids)  # validated; free when already a token array
    if len(token_ids):
        # min/max run in C; array() in token_array would raise OverflowError, not this ValueError.
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high > _MAX_TOKEN_ID:
            raise ValueError(f"token id {low if low < 0 else high} outside 0..{_MAX_TOKEN_ID}")
    return token_array(token_ids)


def chain_after(
    model: ModelFingerprint,
    tenant: str,
    tokens: np.ndarray,
    block_size: int,
    known_tokens: np.ndarray | None,
    known: SessionBlocks | None,
) -> SessionBlocks:
    """`chain_block_keys` of `tokens` (a token array), hashing only the blocks past `known` when
    `known_tokens` (whose keys `known` holds) are a prefix of them: a resumed turn costs what it adds."""
    if known is not None and known_tokens is not None and np.array_equal(known_tokens, tokens[: len(known_tokens)]):
        return chain_block_keys(model, tenant, tokens, block_size, known)
    return chain_block_keys(model, tenant, tokens, block_size)
