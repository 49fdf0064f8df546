"""`symphony up --regions`-style clusters for real: three regions of one SmolLM2 engine each, a
scheduler per region, the global layer's entries and the WAN links (public-cloud matrix), all
started by `symphony up` on this machine. Answers are checked at temperature 0, so a request served
through another region's scheduler still gets the right tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import openai
import pytest

from global_layer.entry import CLIENT_REGION_HEADER, REGION_HEADER
from symphony.config import default_home
from symphony.models import fetch_default_model
from tests.e2e.conftest import LiveCluster, SharedCluster, start_cluster, stop_cluster

pytestmark = pytest.mark.e2e

REGIONS = ["us-east:1", "eu-west:1", "ap-south:1"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def regions_cluster(tmp_path_factory: pytest.TempPathFactory, shared_cluster: SharedCluster) -> Iterator[LiveCluster]:
    shared_cluster.stop()  # three engines of its own: the shared cluster's go first
    model_dir = fetch_default_model(default_home(), progress=lambda _: None)
    cluster = start_cluster(tmp_path_factory.mktemp("symphony-regions"), model_dir, regions=REGIONS)
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


def _entry(cluster: LiveCluster, index: int) -> str:
    port = int(cluster.url.rsplit(":", 1)[1]) + index
    return f"http://127.0.0.1:{port}/v1"


def _ask(url: str, **headers: str) -> tuple[str, str, float]:
    """(answer, serving region, seconds) of one greedy question."""
    client = openai.OpenAI(base_url=url, api_key="none", default_headers=headers, max_retries=0, timeout=120)
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct",
        messages=QUESTION,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    elapsed = time.perf_counter() - started
    return raw.parse().choices[0].message.content or "", raw.headers[REGION_HEADER], elapsed


def test_each_region_serves_its_clients_and_a_far_client_crosses_the_wan(
    regions_cluster: LiveCluster, own_engines: None
) -> None:
    answers = {}
    for index, name in enumerate(("us-east", "eu-west", "ap-south")):
        text, served_by, _ = _ask(_entry(regions_cluster, index))
        assert served_by == name
        answers[name] = text
    assert all("Paris" in text for text in answers.values()), answers
    assert len(set(answers.values())) == 1, f"greedy answers differ between regions: {answers}"
    # An ap-south client at the us-east entry: served in ap-south, over the 190 ms link.
    text, served_by, elapsed = _ask(_entry(regions_cluster, 0), **{CLIENT_REGION_HEADER: "ap-south"})
    assert served_by == "ap-south" and text == answers["us-east"]
    assert elapsed >= 0.19 * 0.9


def test_status_shows_the_regions_and_their_links(regions_cluster: LiveCluster, own_engines: None) -> None:
    config = regions_cluster.home / "symphony.toml"
    shown = subprocess.run(
        [sys.executable, "-m", "symphony.cli", "status", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")},
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    for name in ("us-east", "eu-west", "ap-south"):
        assert f"region {name}" in shown.stdout
    assert "link ap-south~us-east" in shown.stdout and "rtt 190 ms" in shown.stdout
    assert "link eu-west~us-east" in shown.stdout and "rtt 75 ms" in shown.stdout
    assert shown.stdout.count("scheduler http://") == 3


def test_killing_a_regions_scheduler_fails_its_traffic_over(regions_cluster: LiveCluster, own_engines: None) -> None:
    os.kill(regions_cluster.scheduler_pid(region="us-east"), signal.SIGKILL)
    # At once: the request is moved on without the client seeing an error.
    text, served_by, _ = _ask(_entry(regions_cluster, 0))
    assert served_by == "eu-west" and "Paris" in text
