"""What the model fingerprint costs a node's start (`python -m eval.fingerprint_cost --out f.json`).

Rounds of three starts, in this order: a first start with the weights out of the page cache (no
cached manifest, files evicted with POSIX_FADV_DONTNEED: what a host that never read them pays, as
far as the hypervisor's own cache lets it be measured), a first start with them cached, and a
start that finds the manifest (`.symphony-fingerprint.json`) beside the model. The model folder's
manifest is rewritten by the run; the fingerprint is the same before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from eval.results import Result, write_result
from node_manager.identity import identify_served_model
from symphony.config import EngineConfig, default_home
from symphony.kv_geometry import geometry_from_model_dir
from symphony.model_identity import CACHE_NAME, weight_files
from symphony.models import default_model_dir

KINDS = ("first_uncached", "first_cached_pages", "cached_manifest")


def _evict(model: Path) -> None:
    for path in weight_files(model):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(model: Path, rounds: int) -> Result:
    engine = EngineConfig()
    geometry = geometry_from_model_dir(model, engine.block_size, engine.dtype)
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    fingerprints = set()
    with tempfile.TemporaryDirectory() as home:
        for _ in range(rounds):
            for kind in KINDS:
                if kind != "cached_manifest":
                    (model / CACHE_NAME).unlink(missing_ok=True)
                if kind == "first_uncached":
                    _evict(model)
                identity, cost = identify_served_model(engine, model, geometry, Path(home))
                if (cost.files_hashed > 0) != (kind != "cached_manifest"):
                    raise RuntimeError(f"{kind}: {cost.files_hashed} files hashed")
                seconds[kind].append(cost.seconds)
                fingerprints.add(identity.fingerprint.hex())
    if len(fingerprints) != 1:
        raise RuntimeError(f"the fingerprint changed between starts: {sorted(fingerprints)}")
    return {
        "model": str(model),
        "bytes": sum(p.stat().st_size for p in weight_files(model)),
        "fingerprint": fingerprints.pop(),
        "layout": identity.page_layout,
        "rounds": rounds,
        "ms": {kind: [round(s * 1000, 2) for s in values] for kind, values in seconds.items()},
        "ms_median": {kind: round(statistics.median(values) * 1000, 2) for kind, values in seconds.items()},
    }


def _table(result: Result) -> None:
    print(f"{result['model']} ({result['bytes']:,} bytes), fingerprint {result['fingerprint'][:12]}")
    for kind in KINDS:
        print(f"  {kind:<20} median {result['ms_median'][kind]:>9.2f} ms   runs {result['ms'][kind]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=default_model_dir(default_home()),
        help="model folder (default: the prepared SmolLM2)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three starts (5)")
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    args = parser.parse_args()
    write_result(measure(args.model, args.rounds), args.out, table=_table)


if __name__ == "__main__":
    main()
