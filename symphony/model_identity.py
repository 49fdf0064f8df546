"""Model identity: the fingerprint every KV page, block key and session carries.

KV bytes are only meaningful to the model that computed them, in the layout its engine packs them:
bfloat16 and float16 pages have the same size, and a fine-tune has the same geometry as its base.
The fingerprint is sha256 over a canonical JSON of

- the weights: a manifest of (file name, size, sha256) of the model's weight files and config.json
  (the config fixes rope, norms and every other thing that shapes K and V);
- the tokenizer's files (token ids mean nothing under another vocabulary);
- the serving settings that change the bytes: dtype, KV cache dtype, block size, the page layout
  the connector copies (`symphony.kv_geometry.page_layout`), and the engine's other arguments save
  those known to leave KV alone (quantization, rope overrides, a revision, adapters all count).

Hashing the weights costs a read of every byte (docs/model-identity.md#cost-at-start), so each
file's sha256 is cached beside the model (`.symphony-fingerprint.json`) with its size and
mtime, and only a file whose size or mtime changed is hashed again. Where the model folder is read
only, the cache lives under `<home>/models/fingerprints/`. A file rewritten in place with the same
size and mtime is not noticed (as `make` would not notice it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from symphony.kv_addressing import ModelFingerprint
from symphony.logs import get_logger
from symphony.models import sha256_file

log = get_logger(__name__)

FORMAT = 1
CACHE_NAME = ".symphony-fingerprint.json"
# What makes the model's KV: weights in every format vLLM loads, and the architecture's config.
# `*.py`: a trust_remote_code model's own modeling code.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.py", "config.json")
# What maps text to token ids (and, for chats, the template around the messages).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


class ModelIdentityError(RuntimeError):
    """The model folder cannot be read to fingerprint it; the message names the file."""


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    fingerprint: ModelFingerprint  # 32 bytes
    weights_sha256: str
    tokenizer_sha256: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    page_layout: str
    engine_args: tuple[str, ...] = ()

    @property
    def short(self) -> str:
        """The first 12 hex digits: what logs and metrics show."""
        return self.fingerprint.hex()[:12]


@dataclass(frozen=True, slots=True)
class FingerprintCost:
    """What computing a fingerprint took: files hashed now vs taken from the cache, and seconds."""

    files_hashed: int
    files_cached: int
    bytes_hashed: int
    seconds: float
    cache_path: Path | None  # where the manifest was kept; None when it could not be written anywhere


def fingerprint_of(
    weights_sha256: str,
    tokenizer_sha256: str,
    dtype: str,
    kv_cache_dtype: str,
    block_size: int,
    page_layout: str,
    engine_args: tuple[str, ...] = (),
) -> ModelIdentity:
    """The identity of a model served with these settings (pure: the digests are given)."""
    canonical = json.dumps(
        {
            "format": FORMAT,
            "weights": weights_sha256,
            "tokenizer": tokenizer_sha256,
            "dtype": dtype,
            "kv_cache_dtype": kv_cache_dtype,
            "block_size": block_size,
            "page_layout": page_layout,
            "engine_args": list(engine_args),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    digest = ModelFingerprint(hashlib.sha256(canonical.encode()).digest())
    return ModelIdentity(
        digest, weights_sha256, tokenizer_sha256, dtype, kv_cache_dtype, block_size, page_layout, engine_args
    )


def identify_model(
    model_dir: Path,
    *,
    dtype: str,
    kv_cache_dtype: str,
    block_size: int,
    page_layout: str,
    fallback_cache_dir: Path,
    engine_args: tuple[str, ...] = (),
) -> tuple[ModelIdentity, FingerprintCost]:
    """Fingerprint the model at `model_dir` as served with these settings. Raises ModelIdentityError
    when a file cannot be read."""
    started = time.perf_counter()
    model_dir = Path(model_dir)
    weights, hashed, cached, nbytes, cache_path = _weights_digest(model_dir, fallback_cache_dir)
    identity = fingerprint_of(
        weights, _tokenizer_digest(model_dir), dtype, kv_cache_dtype, block_size, page_layout, engine_args
    )
    return identity, FingerprintCost(hashed, cached, nbytes, time.perf_counter() - started, cache_path)


def weight_files(model_dir: Path) -> list[Path]:
    found = {p for pattern in WEIGHT_PATTERNS for p in model_dir.glob(pattern) if p.is_file()}
    return sorted(found, key=lambda p: p.name)


def _weights_digest(model_dir: Path, fallback_cache_dir: Path) -> tuple[str, int, int, int, Path | None]:
    """(sha256 over the manifest, files hashed, files from the cache, bytes hashed, cache path)."""
    files = weight_files(model_dir)
    if not files:
        raise ModelIdentityError(f"{model_dir} has no weights or config.json to fingerprint")
    beside = model_dir / CACHE_NAME
    elsewhere = fallback_cache_dir / f"{hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:32]}.json"
    known, found_at = _read_cache(beside), beside
    if not known:
        known, found_at = _read_cache(elsewhere), elsewhere
    try:
        stats = {path: path.stat() for path in files}
    except OSError as exc:
        raise ModelIdentityError(f"cannot read {exc.filename} to fingerprint the model: {exc.strerror}") from None
    digests = {path: _cached_digest(known.get(path.name), stats[path]) for path in files}
    unknown = [path for path, digest in digests.items() if digest is None]
    if unknown:  # a first start, or changed weights: this reads every byte of them once
        log.info(
            "hashing model files for the model fingerprint",
            model=str(model_dir),
            files=len(unknown),
            bytes=sum(stats[path].st_size for path in unknown),
        )
    for path in unknown:
        try:
            digests[path] = sha256_file(path)
        except OSError as exc:
            raise ModelIdentityError(f"cannot read {path} to fingerprint the model: {exc.strerror}") from None
    manifest: dict[str, dict[str, int | str]] = {
        path.name: {"size": stats[path].st_size, "mtime_ns": stats[path].st_mtime_ns, "sha256": str(digests[path])}
        for path in files
    }
    hashed, cached = len(unknown), len(files) - len(unknown)
    nbytes = sum(stats[path].st_size for path in unknown)
    cache_path: Path | None = found_at
    if unknown or not known:
        cache_path = _write_cache(beside, manifest) or _write_cache(elsewhere, manifest)
        if cache_path is None:
            log.warning(
                "model fingerprint manifest could not be cached; the weights are hashed at every start",
                model=str(model_dir),
                tried=f"{beside}, {elsewhere}",
            )
    # The digest covers names, sizes and hashes, not mtimes: a copy of the same files is the same model.
    canonical = json.dumps({name: [e["size"], e["sha256"]] for name, e in manifest.items()}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest(), hashed, cached, nbytes, cache_path


def _cached_digest(entry: dict[str, object] | None, stat: os.stat_result) -> str | None:
    """The cached sha256 of a file whose size and mtime are still those the cache recorded."""
    if entry is None or entry.get("size") != stat.st_size or entry.get("mtime_ns") != stat.st_mtime_ns:
        return None
    digest = entry.get("sha256")
    return digest if isinstance(digest, str) and len(digest) == 64 else None


def _read_cache(path: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        return {}
    return {name: entry for name, entry in data["files"].items() if isinstance(entry, dict)}


def _write_cache(path: Path, manifest: dict[str, dict[str, int | str]]) -> Path | None:
    """Write atomically (temp file, rename): two nodes starting at once on one model both write it."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": FORMAT, "files": manifest}, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return None
    return path


def _tokenizer_digest(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = model_dir / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ModelIdentityError(f"cannot read {path} to fingerprint the tokenizer: {exc.strerror}") from None
        digest.update(f"{name}\x00{len(data)}\x00".encode())
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()
