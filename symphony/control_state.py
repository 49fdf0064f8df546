"""Control state: what an admin changes while the cluster runs (priority tiers, tenants' quotas,
residency rules), kept so that a restarted process finds it again.

The document holds the admin API's changes only; the configuration (`[quotas]`,
`regions.residency`) stays the baseline they apply over, and `symphony admin ... clear` (or a
rule set back to null) removes a change. Backends share `ControlStore`'s two calls; the local one
is a JSON file per process (`ControlFile`). A coordination store (etcd, for several scheduler
replicas) is the next backend behind the same calls.

Failure modes: a file that is not a valid document (bad JSON, an unknown field, a value out of
range) raises `ControlStateError` and the process does not start: quietly dropping a residency
rule would let a tenant's data leave its regions. A save that fails (a full or read-only disk)
raises OSError; the caller reports that the change holds only until a restart.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Protocol

import pydantic

from symphony.config_secrets import write_private

MAX_DOCUMENT_BYTES = 16 << 20  # far above the tables' bounds (priorities, quotas, residency rules)


class ControlStateError(ValueError):
    """A stored document that cannot be used: the message names the file and the fault."""


class SessionPriority(pydantic.BaseModel, extra="forbid"):
    tenant: str
    session_id: str
    priority: Literal["low", "high"]  # "normal" is no entry


class ControlDocument(pydantic.BaseModel, extra="forbid"):
    """Version 1. Tenants' and sessions' tiers other than normal; per tenant the admin API changed,
    its quota limits (whole `TenantLimits`; null: back to the defaults, over any `[quotas]`
    override) and its residency rule (the regions allowed; null: the rule removed)."""

    version: Literal[1] = 1
    tenant_priorities: dict[str, Literal["low", "high"]] = {}
    session_priorities: list[SessionPriority] = []
    quotas: dict[str, dict[str, int | float] | None] = {}
    residency: dict[str, list[str] | None] = {}

    def empty(self) -> bool:
        return not (self.tenant_priorities or self.session_priorities or self.quotas or self.residency)


class ControlStore(Protocol):
    def load(self) -> ControlDocument: ...

    def save(self, document: ControlDocument) -> None: ...


class ControlFile:
    """One JSON file, replaced whole at each save (written to a temporary file, fsynced, renamed
    over the old one, then the directory fsynced): a crash leaves the old document or the new one.
    Owner-only (0600). Not safe for two processes saving the same file: each process has its own."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> ControlDocument:
        """The stored document; an empty one when there is no file yet."""
        try:
            with self.path.open("rb") as fh:
                raw = fh.read(MAX_DOCUMENT_BYTES + 1)
        except FileNotFoundError:
            return ControlDocument()
        if len(raw) > MAX_DOCUMENT_BYTES:
            raise ControlStateError(f"{self.path}: larger than {MAX_DOCUMENT_BYTES} bytes: not a control state file")
        try:
            return ControlDocument.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "the document"
            raise ControlStateError(
                f"{self.path}: {where}: {first['msg']} (fix or remove the file; it holds the admin API's changes)"
            ) from None

    def save(self, document: ControlDocument) -> None:
        write_private(self.path, document.model_dump_json(indent=1) + "\n")
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power cut
        finally:
            os.close(directory)
