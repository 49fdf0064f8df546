"""The global layer keeps the residency rules its admin API set (global_layer.residency_admin):
saved to `<home>/state/global.json` on each change, restored over the configuration at start,
given way to a configuration that changed since; a rule that cannot be saved is a 503."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from global_layer.residency_admin import SharedTopology, global_state_path
from global_layer.server import make_entries, start_entry
from symphony.config import SymphonyConfig, load_config
from symphony.control_state import ControlFile, ControlStateError
from symphony.residency_rules import known_tenants, listing
from tests.helpers import free_port_run

ADMIN = {"Authorization": "Bearer ops-token"}
KEYS = ["acme:key-acme", "eu:key-eu"]


def _config(home: Path, residency: list[str]) -> SymphonyConfig:
    return load_config(
        env={"SYMPHONY_HOME": str(home)},
        overrides={
            "scheduler": {"port": free_port_run(2), "api_keys": KEYS, "admin_token": "ops-token"},
            "cluster": {"nodes": 2, "secret": "s" * 32, "tls": False},
            "kv": {"data_plane": "grpc"},
            "regions": {
                "layout": ["us-east:1", "eu-west:1"],
                "links": ["us-east~eu-west:40:1000"],
                "residency": residency,
            },
        },
    )


def _restarted(config: SymphonyConfig) -> SharedTopology:
    """What a restarted global layer routes by (server.make_entries builds it so)."""
    topology = config.topology()
    assert topology is not None
    shared = SharedTopology(topology, ControlFile(global_state_path(config)))
    shared.restore(known_tenants(config.scheduler.api_keys))
    return shared


async def _put(config: SymphonyConfig, body: dict[str, Any], broken_store: bool = False) -> httpx.Response:
    topology = config.topology()
    assert topology is not None
    entry = make_entries(config, topology)[0]
    if broken_store:

        def full(*_: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        assert entry.shared.store is not None
        entry.shared.store.save = full  # type: ignore[method-assign]
    port = config.scheduler.port
    server = await start_entry(entry, "127.0.0.1", port)
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            return await client.put(f"http://127.0.0.1:{port}/admin/v1/residency", json=body, headers=ADMIN)
    finally:
        await server.close()


async def test_a_rule_set_at_the_global_layer_is_back_after_a_restart(tmp_path: Path) -> None:
    config = _config(tmp_path, ["eu=eu-west"])
    assert (await _put(config, {"tenant": "acme", "regions": ["us-east"]})).status_code == 200
    assert (await _put(config, {"tenant": "eu", "regions": None})).status_code == 200  # the configured one cleared
    stored = json.loads(global_state_path(config).read_text())["residency"]
    assert stored == {"acme": {"regions": ["us-east"], "config": None}, "eu": {"regions": None, "config": ["eu-west"]}}
    assert global_state_path(config).stat().st_mode & 0o777 == 0o600
    restarted = _restarted(config)
    assert listing(restarted.current) == {"acme": ["us-east"]}  # eu's clear held over the configuration
    # The configuration's rule for eu changed since the clear: the configuration wins.
    changed = _restarted(_config(tmp_path, ["eu=us-east"]))
    assert listing(changed.current) == {"acme": ["us-east"], "eu": ["us-east"]}


async def test_a_rule_that_cannot_be_saved_is_a_503_and_a_damaged_file_stops_the_start(tmp_path: Path) -> None:
    config = _config(tmp_path, [])
    refused = await _put(config, {"tenant": "acme", "regions": ["eu-west"]}, broken_store=True)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "state_not_saved"
    global_state_path(config).parent.mkdir(parents=True, exist_ok=True)
    global_state_path(config).write_text('{"residency": {"acme": {"regions": ["mars"], "config": null}}}')
    with pytest.raises(ControlStateError, match=r"global\.json"):
        _restarted(config)
