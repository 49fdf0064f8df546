"""symphony.kv_geometry and node_manager.kv.pages: page sizes, checksums, tiers and priorities."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node_manager.kv.pages import KEY_ID_BYTES, PageMac, Priority, Tier
from symphony.kv_addressing import tenant_root
from symphony.kv_geometry import KVGeometry, geometry_from_model_dir, smollm2_geometry
from tests.helpers import TEST_MODEL


def test_small_geometry_sizes() -> None:
    geometry = KVGeometry(num_layers=4, kv_heads=1, head_size=8, block_size=4)
    assert geometry.page_bytes == 1 * 4 * 2 * 8 * 2 == 128
    assert geometry.page_words == 16
    assert geometry.block_bytes == 512
    assert geometry.bytes_per_token() == 128.0
    assert KVGeometry(num_layers=4, kv_heads=1, head_size=4, block_size=4).page_bytes == 64


def test_float32_doubles_the_page() -> None:
    assert KVGeometry(4, 1, 8, 4, dtype="float32").page_bytes == 256


def test_smollm2_geometry() -> None:
    geometry = smollm2_geometry()
    assert (geometry.num_layers, geometry.kv_heads, geometry.head_size, geometry.block_size) == (30, 3, 64, 32)
    assert geometry.page_bytes == 3 * 32 * 2 * 64 * 2
    assert geometry.bytes_per_token() == 23040.0
    assert smollm2_geometry(16).block_size == 16


@pytest.mark.parametrize("field", ["num_layers", "kv_heads", "head_size", "block_size"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_dimensions_rejected(field: str, value: int) -> None:
    kwargs = {"num_layers": 4, "kv_heads": 1, "head_size": 8, "block_size": 4, field: value}
    with pytest.raises(ValueError, match=field):
        KVGeometry(**kwargs)


def test_unknown_dtype_rejected() -> None:
    with pytest.raises(ValueError, match="dtype"):
        KVGeometry(4, 1, 8, 4, dtype="int8")


def test_page_not_multiple_of_eight_bytes_rejected() -> None:
    # 1 head * 1 token * 2 * 1 dim * 2 bytes = 4 bytes
    with pytest.raises(ValueError, match="multiple"):
        KVGeometry(1, 1, 1, 1)


def write_config(directory: Path, **cfg: object) -> Path:
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def test_geometry_from_model_dir(tmp_path: Path) -> None:
    model = write_config(
        tmp_path,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        torch_dtype="bfloat16",
    )
    assert geometry_from_model_dir(model, 32, "auto") == smollm2_geometry(32)


def test_geometry_from_model_dir_defaults(tmp_path: Path) -> None:
    model = write_config(tmp_path, num_hidden_layers=2, num_attention_heads=4, hidden_size=64, head_dim=32)
    geometry = geometry_from_model_dir(model, 8, "auto")
    assert geometry == KVGeometry(2, 4, 32, 8, "bfloat16")  # kv heads = heads, explicit head_dim, bf16 default
    assert geometry_from_model_dir(model, 8, "float32").dtype == "float32"


@pytest.mark.parametrize("content", [None, "{not json", json.dumps({"num_attention_heads": 4})])
def test_geometry_from_bad_model_dir(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=r"config\.json"):
        geometry_from_model_dir(tmp_path, 16, "auto")


def test_page_mac_covers_key_layer_bytes_and_secret() -> None:
    key_a, key_b = tenant_root(TEST_MODEL, "a"), tenant_root(TEST_MODEL, "b")
    mac = PageMac(b"a cluster secret of 32 characters")
    data = bytes(range(64))
    base = mac.tag(key_a, 0, data)
    assert base == mac.tag(key_a, 0, memoryview(bytearray(data)))
    assert base == PageMac(b"a cluster secret of 32 characters").tag(key_a, 0, data)  # a peer's, same secret
    assert 0 <= base < 2**64
    assert mac.tag(key_b, 0, data) != base
    assert mac.tag(key_a, 1, data) != base
    flipped = bytearray(data)
    flipped[17] ^= 0x04
    assert mac.tag(key_a, 0, bytes(flipped)) != base
    # Whoever lacks the secret cannot make the tag: not with another secret, not with none.
    other = PageMac(b"another secret, also 32 chars...")
    assert other.tag(key_a, 0, data) != base
    assert PageMac(b"").tag(key_a, 0, data) != base
    # The key id names the key and differs between keys, without being the key or a tag under it.
    assert len(mac.key_id) == KEY_ID_BYTES
    assert mac.key_id != other.key_id != PageMac(b"").key_id
    assert mac.key_id == PageMac(b"a cluster secret of 32 characters").key_id


def test_run_tags_equal_tags_one_by_one() -> None:
    mac = PageMac(b"a cluster secret of 32 characters")
    keys = [tenant_root(TEST_MODEL, f"t{i}") for i in range(5)]
    data = memoryview(bytes(range(256)) * 5)  # five 256-byte pages back to back
    assert mac.run_tags(keys, 3, data, 256) == [
        mac.tag(key, 3, data[i * 256 : (i + 1) * 256]) for i, key in enumerate(keys)
    ]
    assert mac.run_tags([], 0, memoryview(b""), 256) == []
    assert mac.run_tags([], 0, memoryview(b""), 0) == []  # an empty batch: page size unknown


def test_tier_and_priority_values() -> None:
    assert [t.name for t in sorted(Tier)] == ["HBM", "DRAM", "SSD"]
    assert Priority.LOW < Priority.NORMAL < Priority.HIGH
    assert Priority.parse("High") is Priority.HIGH
    assert Priority.parse("low") is Priority.LOW
    with pytest.raises(ValueError, match="priority"):
        Priority.parse("urgent")


def test_priority_is_defined_once_and_maps_to_store_and_wire() -> None:
    from symphony.priority import PRIORITIES
    from symphony.priority import Priority as SessionPriority
    from symphony.v1 import kv_pb2

    assert [p.value for p in PRIORITIES] == ["low", "normal", "high"]
    assert [Priority.of(p) for p in PRIORITIES] == [Priority.LOW, Priority.NORMAL, Priority.HIGH]
    assert [Priority.of(p).tier for p in PRIORITIES] == list(PRIORITIES)
    wire = [kv_pb2.PRIORITY_LOW, kv_pb2.PRIORITY_NORMAL, kv_pb2.PRIORITY_HIGH]
    assert [p.proto for p in PRIORITIES] == wire
    assert [Priority.from_proto(v) for v in wire] == [Priority.LOW, Priority.NORMAL, Priority.HIGH]
    assert Priority.from_proto(kv_pb2.PRIORITY_UNSPECIFIED) is None
    assert Priority.from_proto(99) is None
    assert SessionPriority.HIGH == "high" and SessionPriority.parse("High") is SessionPriority.HIGH
    with pytest.raises(ValueError, match="low, normal, high"):
        SessionPriority.parse("urgent")
