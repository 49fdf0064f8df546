"""Control state: what an admin changes while the cluster runs (priority tiers, tenants' quotas,
residency rules), kept so that a restarted process finds it again.

The document holds the admin API's changes only; the configuration (`[quotas]`,
`regions.residency`) stays the baseline they apply over, and `symphony admin ... clear` (or a
rule set back to null) removes a change. Backends share `ControlStore`'s two calls; the local one
is a JSON file per process (`ControlFile`); with a coordination store, one etcd key per tenant and
per session tier, shared by a scheduler's replicas (`symphony.control_etcd`).

Failure modes: a file that is not a valid document (bad JSON, an unknown field, a value out of
range) raises `ControlStateError` and the process does not start: quietly dropping a residency
rule would let a tenant's data leave its regions. A save that fails (a full or read-only disk)
raises OSError; the caller reports that the change holds only until a restart.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import pydantic
from pydantic import StrictFloat, StrictInt

from symphony.config_secrets import write_private
from symphony.logs import get_logger
from symphony.regions import RegionTopology
from symphony.residency_rules import parse_update, with_rule

log = get_logger(__name__)

# Above what the tables' bounds allow (100,000 session tiers of 128-character names: ~30 MB
# compact); a save past it is refused (the change is then not saved), never written unreadable.
MAX_DOCUMENT_BYTES = 64 << 20


class ControlStateError(ValueError):
    """A stored document that cannot be used: the message names the file and the fault."""


class SessionPriority(pydantic.BaseModel, extra="forbid"):
    tenant: str
    session_id: str
    priority: Literal["low", "high"]  # "normal" is no entry


class QuotaChange(pydantic.BaseModel, extra="forbid"):
    """A tenant's quota changes: `cleared`, back to the defaults first (over any `[quotas]`
    override of the tenant); then `limits`, the keys the admin set, over what the configuration
    gives (so a later edit of another key in the configuration still reaches the tenant)."""

    cleared: bool = False
    limits: dict[str, StrictInt | StrictFloat] = {}


class RuleChange(pydantic.BaseModel, extra="forbid"):
    """A tenant's residency rule as the admin set it (`regions`; null: removed), and the
    configuration's rule for the tenant when it was set (`config`): a configuration that has changed
    since wins over the stored change."""

    regions: list[str] | None
    config: list[str] | None


def with_kept_rule(
    topology: RegionTopology,
    tenant: str,
    rule: RuleChange,
    configured: Mapping[str, list[str]],
    tenants: frozenset[str],
) -> RegionTopology | None:
    """`topology` with `tenant`'s kept residency rule applied over the configuration as it is now
    (`configured`: its rules, before any change applies). None, with a warning, when the
    configuration's rule for the tenant is no longer the one the rule was set over: the
    configuration wins. RuleError or OverflowError for a rule that cannot apply (a region not in
    the layout; the table full)."""
    if configured.get(tenant) != rule.config:
        log.warning(
            "kept residency rule dropped: the configuration's rule changed since it was set",
            tenant=tenant,
            kept=str(rule.regions),
            configured=str(configured.get(tenant)),
        )
        return None
    name, allowed = parse_update({"tenant": tenant, "regions": rule.regions}, topology, tenants)
    return with_rule(topology, name, allowed)


class ControlDocument(pydantic.BaseModel, extra="forbid"):
    """Version 1. Tenants' and sessions' tiers other than normal; per tenant the admin API
    changed, its quota changes and its residency rule."""

    version: Literal[1] = 1
    tenant_priorities: dict[str, Literal["low", "high"]] = {}
    session_priorities: list[SessionPriority] = []
    quotas: dict[str, QuotaChange] = {}
    residency: dict[str, RuleChange] = {}

    def empty(self) -> bool:
        return not (self.tenant_priorities or self.session_priorities or self.quotas or self.residency)


@dataclass(frozen=True, slots=True)
class Changed:
    """What one admin change touched: a tenant's settings, or one session's tier."""

    tenant: str
    session_id: str | None = None


class ControlStore(Protocol):
    where: str  # what it is kept in, for messages

    def load(self) -> ControlDocument: ...

    def save(self, document: ControlDocument, changed: Changed) -> int | None:
        """Store `document`, the state after the change `changed` (a store may write only what it
        touched); a store with revisions returns the write's. OSError when it cannot."""
        ...


class ControlFile:
    """One JSON file, replaced whole at each save (written to a temporary file, fsynced, renamed
    over the old one, then the directory fsynced): a crash leaves the old document or the new one.
    Owner-only (0600). Not safe for two processes saving the same file: each process has its own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)

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

    def save(self, document: ControlDocument, changed: Changed | None = None) -> None:
        """The whole document, whatever changed. OSError when it cannot be written, EFBIG for a
        document past MAX_DOCUMENT_BYTES."""
        text = document.model_dump_json() + "\n"
        if len(text) > MAX_DOCUMENT_BYTES:
            raise OSError(errno.EFBIG, f"the control state would take {len(text)} bytes, over {MAX_DOCUMENT_BYTES}")
        write_private(self.path, text)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power cut
        finally:
            os.close(directory)
