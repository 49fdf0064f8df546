"""node_manager.kv.tiers: each concrete tier has every member its Protocol names, methods with the same
parameters."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest

from node_manager.kv.slots import DevicePool, DramArena
from node_manager.kv.ssd_tier import SsdTier
from node_manager.kv.tiers import ArenaTier, SegmentTier, SlotTier
from tests.helpers import TEST_MODEL
from tests.unit.kv_store_support import GEOMETRY, PAGE


def _members(protocol: type) -> tuple[set[str], dict[str, object]]:
    """The attributes a Protocol declares and its methods, its bases' included."""
    attributes: set[str] = set()
    methods: dict[str, object] = {}
    for base in reversed(protocol.__mro__):  # a Protocol's own declaration wins over its bases'
        if base is object or base is Protocol or base.__module__ == "typing":
            continue
        attributes |= set(inspect.get_annotations(base))
        methods.update((name, value) for name, value in vars(base).items() if inspect.isfunction(value))
    return attributes, {name: value for name, value in methods.items() if not name.startswith("_")}


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[dict[str, object]]:
    arena = DramArena(f"symphony-test-{uuid.uuid4().hex[:8]}", GEOMETRY, 4 * PAGE)
    pool = DevicePool(GEOMETRY, 4 * PAGE, "cpu")
    try:
        yield {"hbm": pool, "dram": arena, "ssd": SsdTier(tmp_path, PAGE, 1 << 20, TEST_MODEL)}
    finally:
        arena.close()
        pool.close()


@pytest.mark.parametrize(
    ("protocol", "tier"),
    [(SlotTier, "hbm"), (SlotTier, "dram"), (ArenaTier, "dram"), (SegmentTier, "ssd")],
)
def test_a_tier_has_every_member_of_its_protocol(tiers: dict[str, object], protocol: type, tier: str) -> None:
    concrete = tiers[tier]
    attributes, methods = _members(protocol)
    assert attributes and methods
    missing = sorted(name for name in attributes | set(methods) if not hasattr(concrete, name))
    assert not missing, f"{type(concrete).__name__} lacks {missing} of {protocol.__name__}"
    for name, method in methods.items():
        declared = list(inspect.signature(method).parameters)  # type: ignore[arg-type]
        assert ["self", *inspect.signature(getattr(concrete, name)).parameters] == declared, name
