"""The KV store's client-facing errors: what its callers (the gRPC service, the IPC server, peer
transfers, prefetches) catch and turn into a status, a retry or a recompute."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of the store's client-facing errors."""


class SessionNotFound(KVStoreError):
    pass


class HistoryChanged(KVStoreError):
    """The session's stored history no longer has the block a caller addressed (another request
    registered a different history under the same session id)."""


class InvalidRequest(KVStoreError):
    pass


class ModelMismatch(KVStoreError):
    """Pages asked for, or offered, under another model's fingerprint than the store's."""


class StoreBusy(KVStoreError):
    """Too much I/O already in flight; the caller should retry later (or recompute)."""
