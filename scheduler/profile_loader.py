"""Reading the cost profile file when the scheduler starts (`scheduler.cost_profile`).

Never fatal: a profile that is missing, unreadable, implausible or stale leaves the built-in
defaults (`scheduler.cost_profile.DEFAULT_PROFILE`) in place, with one structured warning that
says why; `symphony status` shows which profile is in use and why (`LoadedProfile.describe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from scheduler.cost_profile import DEFAULT_PROFILE, CostProfile, ProfileError, from_json, problems, staleness, summary
from symphony.logs import get_logger

log = get_logger(__name__)


class ProfileStatus(StrEnum):
    LOADED = "loaded"  # the file's profile is in use
    MISSING = "missing"  # no file: defaults
    INVALID = "invalid"  # unreadable or implausible: defaults
    STALE = "stale"  # too old, another host or another model: defaults


@dataclass(frozen=True, slots=True)
class LoadedProfile:
    profile: CostProfile  # the one in use
    path: str
    status: ProfileStatus
    problem: str = ""  # why the defaults are in use (empty when loaded)

    def describe(self) -> dict[str, Any]:
        """What /readyz (and so `symphony status`) reports."""
        return {"path": self.path, "status": str(self.status), "problem": self.problem, **summary(self.profile)}


def load_cost_profile(path: Path, *, host: str, model: str, now_unix_s: float, max_age_s: float) -> LoadedProfile:
    """The profile at `path` if it is plausible and describes this cluster now (measured on `host`,
    with the served `model`, at most `max_age_s` before `now_unix_s`); otherwise the defaults, with a
    warning logged."""
    where = str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return _defaults(where, ProfileStatus.MISSING, "no cost profile file; run `symphony bench calibrate`")
    except OSError as exc:
        return _defaults(where, ProfileStatus.INVALID, f"cannot read it: {exc.strerror or exc}")
    try:
        profile = from_json(text)
    except ProfileError as exc:
        return _defaults(where, ProfileStatus.INVALID, str(exc))
    found = problems(profile)
    if found:
        return _defaults(where, ProfileStatus.INVALID, "; ".join(found))
    stale = staleness(profile, host=host, model=model, now_unix_s=now_unix_s, max_age_s=max_age_s)
    if stale is not None:
        return _defaults(where, ProfileStatus.STALE, f"{stale}; run `symphony bench calibrate` again")
    log.info("cost profile loaded", path=where, host=profile.host, model=profile.model, links=len(profile.links))
    return LoadedProfile(profile, where, ProfileStatus.LOADED)


def _defaults(path: str, status: ProfileStatus, problem: str) -> LoadedProfile:
    log.warning("cost profile not used; routing on defaults", path=path, status=str(status), problem=problem)
    return LoadedProfile(DEFAULT_PROFILE, path, status, problem)
