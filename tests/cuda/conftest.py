"""The CUDA suite (`make test-cuda`): the KV store and the connector's worker side against a real GPU.

Not part of `make test` (not in `testpaths`): CI and the development hosts have no GPU. Run
without one, the suite stops at its first test with an error rather than skipping: a GPU run that
skipped would read as a pass."""

from __future__ import annotations

import pytest
import torch

from tests.unit.conftest import make_store, ssd_dir  # noqa: F401 - the store fixtures, shared

# torch.cuda._sleep spins the GPU for this many clock cycles (about 0.1 s at the H100's 1.98 GHz):
# long enough that a copy queued behind it has surely not run when a racing reader looks.
DELAY_CYCLES = 200_000_000


@pytest.fixture(autouse=True)
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.exit("tests/cuda needs a CUDA device (make test-cuda on a GPU host)", returncode=1)
    return torch.device("cuda")


def hold_stream(stream: torch.cuda.Stream | None = None) -> None:
    """Keep `stream` (the current one by default) busy for a while: what is queued on it after this
    runs late, so a reader that does not wait for it sees the bytes from before."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        torch.cuda._sleep(DELAY_CYCLES)
