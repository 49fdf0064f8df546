"""The admin API's changes outlive a scheduler restart (`scheduler.control`): priority tiers,
quota changes and residency rules are saved to `<home>/state/` and restored by the next
scheduler on the same home, over the configuration. A damaged file stops the scheduler from
starting; a save that fails is a 503 that says the change holds until a restart."""

from __future__ import annotations

import errno
import json
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from scheduler.app import create_app
from scheduler.control import control_path
from scheduler.state import SchedulerState
from symphony.config import SymphonyConfig, load_config
from symphony.control_state import ControlStateError

ADMIN = "ops-token"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
KEYS = ["acme:key-acme", "globex:key-globex"]
REGIONS = {"layout": ["us-east:1", "eu-west:1"], "links": ["us-east~eu-west:40:1000"]}


def _config(
    home: Path,
    quotas: dict[str, Any] | None = None,
    residency: list[str] | None = None,
    cluster: dict[str, Any] | None = None,
    **scheduler: Any,
) -> SymphonyConfig:
    overrides: dict[str, Any] = {
        "scheduler": {"api_keys": KEYS, "admin_token": ADMIN, "node_addresses": ["127.0.0.1:1"], **scheduler},
        # The configuration's override of acme.
        "quotas": {"tenants": ["acme:requests_per_s=5"], **(quotas or {})},
        "cluster": {"secret": "s" * 32, "tls": False, **(cluster or {})},
    }
    if "region" in scheduler:
        regions = {**REGIONS, "residency": residency or []}
        overrides |= {"regions": regions, "cluster": {**overrides["cluster"], "nodes": 2}, "kv": {"data_plane": "grpc"}}
    return load_config(env={"SYMPHONY_HOME": str(home)}, overrides=overrides)


async def _admin(state: SchedulerState, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    app = create_app(state.config, state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://scheduler") as http:
        return await http.request(method, "/admin/v1" + path, json=body, headers=ADMIN_HEADERS)


async def _listings(state: SchedulerState) -> tuple[Any, Any]:
    return (await _admin(state, "GET", "/priorities")).json(), (await _admin(state, "GET", "/quotas")).json()


async def test_tiers_and_quota_changes_are_back_after_a_restart(tmp_path: Path) -> None:
    first = SchedulerState(_config(tmp_path))
    for body in (
        {"tenant": "acme", "priority": "high"},
        {"tenant": "globex", "session_id": "chat-7", "priority": "low"},
    ):
        assert (await _admin(first, "PUT", "/priorities", body)).status_code == 200
    changed = {"tenant": "globex", "limits": {"max_inflight": 3, "weight": 2.5}}
    assert (await _admin(first, "PUT", "/quotas", changed)).status_code == 200
    cleared = {"tenant": "acme", "limits": None}  # back to the defaults, over `[quotas]`' override
    assert (await _admin(first, "PUT", "/quotas", cleared)).status_code == 200
    before = await _listings(first)

    path = control_path(first.config)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    restarted = SchedulerState(_config(tmp_path))
    assert await _listings(restarted) == before
    assert restarted.priorities.of("globex", "chat-7").value == "low"
    assert restarted.quotas.limits("globex").max_inflight == 3
    assert restarted.quotas.limits("acme").requests_per_s == 0  # the clear held, not the config's 5

    # A fresh home restores nothing: the configuration alone.
    fresh = SchedulerState(_config(tmp_path / "other"))
    assert fresh.quotas.limits("acme").requests_per_s == 5 and fresh.priorities.of("acme", None).value == "normal"


async def test_a_residency_rule_is_back_after_a_restart(tmp_path: Path) -> None:
    first = SchedulerState(_config(tmp_path, region="us-east"))
    answer = await _admin(first, "PUT", "/residency", {"tenant": "acme", "regions": ["eu-west"]})
    assert answer.status_code == 200, answer.text
    restarted = SchedulerState(_config(tmp_path, region="us-east"))
    assert (await _admin(restarted, "GET", "/residency")).json()["rules"] == {"acme": ["eu-west"]}
    assert control_path(restarted.config).name == "scheduler-us-east.json"
    other_region = SchedulerState(_config(tmp_path, region="eu-west"))  # a file of its own
    assert (await _admin(other_region, "GET", "/residency")).json()["rules"] == {}


async def test_the_configuration_as_it_is_now_is_the_baseline(tmp_path: Path) -> None:
    """A quota change keeps only the keys the admin set: the configuration's later edit of another
    key reaches the tenant. A residency rule whose configuration changed since gives way to it."""
    first = SchedulerState(_config(tmp_path, region="us-east"))
    assert (
        await _admin(first, "PUT", "/quotas", {"tenant": "globex", "limits": {"max_inflight": 3}})
    ).status_code == 200
    assert (await _admin(first, "PUT", "/residency", {"tenant": "acme", "regions": ["eu-west"]})).status_code == 200
    assert (await _admin(first, "PUT", "/residency", {"tenant": "globex", "regions": ["us-east"]})).status_code == 200

    edited = _config(tmp_path, quotas={"requests_per_s": 7.0}, residency=["acme=us-east"], region="us-east")
    restarted = SchedulerState(edited)
    assert restarted.quotas.limits("globex").max_inflight == 3  # the admin's key
    assert restarted.quotas.limits("globex").requests_per_s == 7.0  # the configuration's edit
    rules = (await _admin(restarted, "GET", "/residency")).json()["rules"]
    assert rules == {"acme": ["us-east"], "globex": ["us-east"]}  # acme's configuration changed: it wins


@pytest.mark.parametrize(
    ("document", "fault"),
    [
        ("{not json", "Invalid JSON"),
        ('{"version": 2}', "version"),
        ('{"tenant_priorities": {"acme": "urgent"}}', "tenant_priorities.acme"),
        ('{"quotas": {"acme": {"limits": {"weight": -1}}}}', "weight"),
        ('{"quotas": {"acme": {"limits": {"no_such_limit": 1}}}}', "no_such_limit"),
        ('{"quotas": {"acme": {"limits": {"max_inflight": true}}}}', "max_inflight"),  # a bool is no number
        ('{"surprise": 1}', "surprise"),
    ],
)
def test_a_damaged_file_stops_the_scheduler_naming_it(tmp_path: Path, document: str, fault: str) -> None:
    path = control_path(_config(tmp_path))
    path.parent.mkdir(parents=True)
    path.write_text(document)
    with pytest.raises(ControlStateError, match=fault) as raised:
        SchedulerState(_config(tmp_path))
    assert str(path) in str(raised.value)


def test_a_rule_for_an_unknown_region_stops_a_regional_scheduler(tmp_path: Path) -> None:
    path = control_path(_config(tmp_path, region="us-east"))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"residency": {"acme": {"regions": ["mars"], "config": None}}}))
    with pytest.raises(ControlStateError, match="mars"):
        SchedulerState(_config(tmp_path, region="us-east"))


async def test_a_change_that_cannot_be_saved_is_a_503_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = SchedulerState(_config(tmp_path))

    def full(*_: object) -> None:  # the fault: the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state.control.store, "save", full)
    answer = await _admin(state, "PUT", "/priorities", {"tenant": "acme", "priority": "high"})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "state_not_saved"
    assert "lost if the scheduler restarts" in answer.json()["error"]["message"]
    assert state.priorities.of("acme", None).value == "high"  # applied here, as the message says
    assert state.metrics.registry.get_sample_value("symphony_control_save_failures_total") == 1


async def test_a_document_past_its_bound_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that would write a file too big to load is refused (503), and the file stays as it
    was: the next start still loads it."""
    state = SchedulerState(_config(tmp_path))
    assert (await _admin(state, "PUT", "/priorities", {"tenant": "acme", "priority": "high"})).status_code == 200
    saved = control_path(state.config).read_bytes()
    monkeypatch.setattr("symphony.control_state.MAX_DOCUMENT_BYTES", len(saved) + 8)
    body = {"tenant": "globex", "session_id": "s" * 64, "priority": "low"}
    answer = await _admin(state, "PUT", "/priorities", body)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "state_not_saved"
    assert control_path(state.config).read_bytes() == saved
    monkeypatch.undo()
    assert SchedulerState(_config(tmp_path)).priorities.of("acme", None).value == "high"
