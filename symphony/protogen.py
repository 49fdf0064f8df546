"""Generate the Python gRPC stubs from `proto/` with grpcio-tools.

Run by setup.py's build step (so every install gets stubs that match the .proto sources), by
`make proto`, and by a test that checks the stubs on disk are the ones the sources produce. Standalone
on purpose: setup.py loads this file before the package is importable.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
# Stubs land where the proto package name puts them (`symphony.v1` -> symphony/v1/), so the imports
# that grpcio-tools writes into *_pb2_grpc.py resolve without rewriting.
OUTPUT_ROOT = REPO_ROOT


def proto_sources(proto_root: Path = PROTO_ROOT) -> list[Path]:
    sources = sorted(proto_root.rglob("*.proto"))
    if not sources:
        raise RuntimeError(f"no .proto files under {proto_root}")
    return sources


def generate(output_root: Path = OUTPUT_ROOT, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every .proto under proto_root; return the generated files."""
    try:
        from grpc_tools import protoc  # type: ignore[import-untyped]  # grpcio-tools ships no types
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("grpcio-tools is required to generate the gRPC stubs: pip install grpcio-tools") from exc
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    sources = proto_sources(proto_root)
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={output_root}",
        f"--pyi_out={output_root}",
        f"--grpc_python_out={output_root}",
        *(str(s.relative_to(proto_root)) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(str(s) for s in sources)}")
    generated = []
    for source in sources:
        stem = output_root / source.relative_to(proto_root).with_suffix("")
        generated += [stem.with_name(stem.name + suffix) for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return generated


def stale_stubs() -> list[Path]:
    """Stubs on disk that differ from what the current .proto sources generate (or are missing)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for fresh_file in fresh:
            on_disk = OUTPUT_ROOT / fresh_file.relative_to(tmp)
            if not on_disk.exists() or on_disk.read_bytes() != fresh_file.read_bytes():
                stale.append(on_disk)
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the stubs on disk are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs()
        for path in stale:
            print(f"stale or missing: {path.relative_to(REPO_ROOT)}", file=sys.stderr)
        return 1 if stale else 0
    for path in generate():
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
