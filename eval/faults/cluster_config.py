"""The fault bench's private cluster: the one a careful operator would deploy on one host (two
nodes with real vLLM engines, two scheduler replicas over an etcd of its own, mutual TLS between
its members, tenants' API keys and an admin token), on ports and a home of its own."""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

from eval.faults.network import linked_config
from eval.ports import free_port_run, private_cluster_config
from symphony.config import SymphonyConfig
from symphony.models import ModelInfo

TENANTS = ("alpha", "beta")  # the load's
ATTACKER = "mallory"  # a tenant that sends nothing but its attacks
# What the nodes' SSD tiers leave free on their filesystems: whatever the user's setting, so that
# the disk scenario's small disk (this plus `eval.faults.disk.SMALL_DISK_ROOM`, filled to ENOSPC in
# memory) has one size. It covers the write-behind's segments in flight many times over.
SSD_HEADROOM = 256 << 20


def faults_config(
    config: SymphonyConfig, home: Path, model: ModelInfo, linked: bool = False
) -> tuple[SymphonyConfig, dict[str, str]]:
    """The private cluster (module docstring) and its tenants' API keys (the attacker's included).
    `linked`: each node advertised at an emulated link's listeners (`eval.faults.network`)."""
    private = private_cluster_config(config, home, 2)
    private = linked_config(private) if linked else private
    keys = {name: secrets.token_urlsafe(16) for name in (*TENANTS, ATTACKER)}
    return dataclasses.replace(
        private,
        cluster=dataclasses.replace(private.cluster, ha=True, tls=True, etcd_port_base=free_port_run(2)),
        scheduler=dataclasses.replace(
            private.scheduler,
            port=free_port_run(2),
            replicas=2,
            api_keys=[f"{name}:{key}" for name, key in keys.items()],
            admin_token=secrets.token_urlsafe(16),
        ),
        engine=dataclasses.replace(
            config.engine, kv_connector=True, model=str(model.path), served_model_name=model.served_name
        ),
        kv=dataclasses.replace(private.kv, ssd_headroom_bytes=SSD_HEADROOM),
    ), keys
