"""The configuration's secrets (tenants' API keys, the admin token, the cluster's secret): kept
host can read. Config files that hold them are written owner-only (0600) and atomically; what is
printed shows a tenant's name, never its key; child processes, which get their configuration from
such a file, do not inherit the environment variables that carry them; and the admin token can be
read from a file or stdin rather than a command line that `ps` shows."""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from symphony.config import ENV_PREFIX, REDACTED, SymphonyConfig
from symphony.tenancy import ENGINE_KEY_ENV

ADMIN_TOKEN_ENV = "SYMPHONY_ADMIN_TOKEN"  # the admin commands' token (not a config key)
# (section, key) of every configuration key that holds a secret.
SECRET_KEYS = (("scheduler", "api_keys"), ("scheduler", "admin_token"), ("cluster", "secret"))
SECRET_ENV_VARS = frozenset(
    {ADMIN_TOKEN_ENV, ENGINE_KEY_ENV, *(f"{ENV_PREFIX}{s}_{k}".upper() for s, k in SECRET_KEYS)}
)
MAX_TOKEN_FILE_BYTES = 4096  # a token file is one line; more is the wrong file
SECRET_FILE = "cluster.secret"  # in the home: the cluster's secret when the configuration sets none
MIN_SECRET_CHARS = 16  # as `cluster.secret` requires


def redacted(config: SymphonyConfig) -> SymphonyConfig:
    """`config` with every API key and the admin token replaced by `REDACTED` (a key's tenant kept:
    "tenant:<redacted>"), for printing. An unset token stays empty: whether one is set shows."""
    scheduler = config.scheduler
    keys = [f"{entry.split(':', 1)[0]}:{REDACTED}" for entry in scheduler.api_keys]
    token = REDACTED if scheduler.admin_token else ""
    secret = REDACTED if config.cluster.secret else ""
    return dataclasses.replace(
        config,
        scheduler=dataclasses.replace(scheduler, api_keys=keys, admin_token=token),
        cluster=dataclasses.replace(config.cluster, secret=secret),
    )


def new_cluster_secret() -> str:
    """A random `cluster.secret`: 256 bits, hex."""
    return secrets.token_hex(32)


def with_cluster_secret(config: SymphonyConfig) -> SymphonyConfig:
    """`config` with its `cluster.secret`: the configured one, else the one kept in the home
    (`SECRET_FILE`, owner-only), made on first use. Kept, not made anew at each start: it keys the
    MACs of the SSD tier's pages, which a restarted cluster must still verify. ValueError names a
    secret file that cannot be read or holds no usable secret."""
    if config.cluster.secret:
        return config
    secret = home_secret(config.home_path / SECRET_FILE)
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, secret=secret))


def home_secret(path: Path) -> str:
    """The secret in `path`, made there first if there is none (atomically: processes racing to
    make it all read the same one, on a filesystem with hard links; elsewhere the last one written
    wins, which a cluster started by one `symphony up` never races). ValueError for a file others
    may read (mode beyond 0600), as ssh refuses a private key's: the secret keys all the cluster
    signs."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(new_cluster_secret() + "\n")
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(tmp, path)  # whole or not at all; another process's made first wins
            except FileExistsError:
                pass
            except OSError:  # a filesystem without hard links: a rename, the last writer wins
                os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"{path} may be read by others (mode {mode:o}): chmod 600 it")
    secret = read_token_file(str(path))
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{path} holds a secret of {len(secret)} characters; at least {MIN_SECRET_CHARS} are needed")
    return secret


def scrubbed_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) without the variables that carry secrets."""
    source = os.environ if env is None else env
    return {name: value for name, value in source.items() if name not in SECRET_ENV_VARS}


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only (0600) from the first byte, replacing any
    earlier file whole (a reader sees the old file or the new one, never part of either)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_token_file(path: str) -> str:
    """The token in file `path` ("-": stdin), its first line stripped. ValueError names what is
    wrong (unreadable, empty, too long)."""
    try:
        if path == "-":
            text = sys.stdin.read(MAX_TOKEN_FILE_BYTES + 1)
        else:
            with open(path, encoding="utf-8") as source:
                text = source.read(MAX_TOKEN_FILE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if len(text) > MAX_TOKEN_FILE_BYTES:
        raise ValueError(f"{path} is longer than {MAX_TOKEN_FILE_BYTES} bytes: not a token file")
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"{path} holds no token")
    return token
