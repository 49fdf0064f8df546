"""`symphony up --regions`-style clusters for real: three regions of one SmolLM2 engine each, a
scheduler per region, the global layer's entries (policy `symphony`) and the WAN links
(public-cloud matrix), all started by `symphony up` on this machine. Answers are checked at
temperature 0, so a request served through another region's scheduler, or on KV moved across
regions, still gets the right tokens. Two tenants have keys: `default` (key "none", what the
`openai` client sends without one) and `atlantic`, whose requests and KV must stay in us-east and
eu-west; the links' per-tenant byte counters show where each tenant's bytes went."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from global_layer.entry import CLIENT_REGION_HEADER, REGION_HEADER
from symphony.config import default_home, load_config
from symphony.link_tenants import OTHER, PENDING, UNATTRIBUTED, UNKNOWN_KEY, residency_crossings
from symphony.models import fetch_default_model
from symphony.tenancy import DEFAULT_TENANT
from tests.e2e.conftest import LiveCluster, SharedCluster, start_cluster, stop_cluster
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e

REGIONS = ["us-east:1", "eu-west:1", "ap-south:1"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ATLANTIC_KEY = "key-atlantic"
RESIDENCY = {"atlantic": frozenset({"us-east", "eu-west"})}


@pytest.fixture(scope="module")
def regions_cluster(tmp_path_factory: pytest.TempPathFactory, shared_cluster: SharedCluster) -> Iterator[LiveCluster]:
    shared_cluster.stop()  # three engines of its own: the shared cluster's go first
    model_dir = fetch_default_model(default_home(), progress=lambda _: None)
    cluster = start_cluster(
        tmp_path_factory.mktemp("symphony-regions"),
        model_dir,
        regions=REGIONS,
        regions_policy="symphony",
        api_keys=["default:none", f"atlantic:{ATLANTIC_KEY}"],
        residency=["atlantic=us-east|eu-west"],
    )
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


def _entry(cluster: LiveCluster, index: int) -> str:
    port = int(cluster.url.rsplit(":", 1)[1]) + index
    return f"http://127.0.0.1:{port}/v1"


def _ask(url: str, api_key: str = "none", **headers: str) -> tuple[str, str, float]:
    """(answer, serving region, seconds) of one greedy question."""
    client = openai.OpenAI(base_url=url, api_key=api_key, default_headers=headers, max_retries=0, timeout=120)
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


@contextlib.contextmanager
def _eu_west_scheduler_stopped(cluster: LiveCluster) -> Iterator[None]:
    """eu-west's scheduler stopped (SIGSTOP: its node, and the KV it holds, stay up) and seen down
    by the global layer, until the block ends."""
    scheduler = cluster.scheduler_pid(region="eu-west")
    os.kill(scheduler, signal.SIGSTOP)
    try:
        wait_until(lambda: not _regions(cluster, 1)["eu-west"]["up"], 30, "eu-west to be seen down")
        yield
    finally:
        os.kill(scheduler, signal.SIGCONT)
    wait_until(lambda: _regions(cluster, 1)["eu-west"]["up"], 30, "eu-west to be seen up again")


def _advise_to_us_east(entry: str, session: str, key: str) -> None:
    """A typing advisory for `session` at `entry`, which sends it to us-east."""
    advised = httpx.post(
        entry + "/advisories",
        json={"session_id": session, "kind": "typing"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert advised.status_code == 202, advised.text
    assert advised.headers[REGION_HEADER] == "us-east"


def _prefetches_done(cluster: LiveCluster) -> int:
    """Prefetches us-east's scheduler has seen finish (its node's pulls among them)."""
    config = load_config(cluster.home / "symphony.toml", env={})
    metrics = httpx.get(
        f"http://127.0.0.1:{config.regions.scheduler_port_base}/metrics", timeout=5, headers=cluster.internal_headers
    )
    assert metrics.status_code == 200, metrics.text  # keys are set: read with the cluster's internal token
    text = metrics.text
    done = 'symphony_prefetches_total{outcome="done"}'
    line = next((line for line in text.splitlines() if line.startswith(done)), "")
    return int(float(line.split()[-1])) if line else 0


def _links(cluster: LiveCluster) -> list[dict[str, Any]]:
    config = load_config(cluster.home / "symphony.toml", env={})
    links = httpx.get(
        f"http://127.0.0.1:{config.regions.link_port_base}/links", timeout=5, headers=cluster.internal_headers
    )
    return links.json()["links"]  # type: ignore[no-any-return]


def _owned(links: list[dict[str, Any]], pair: str, tenant: str) -> tuple[int, int, int]:
    """A tenant's bytes on a pair's link: (one lane, the other, of them KV to and from nodes)."""
    link = next(link for link in links if link["pair"] == pair)
    lanes = [counts.get(tenant, 0) for _, counts in sorted(link["tenant_bytes"].items())]
    return lanes[0], lanes[1], link["tenant_kv_bytes"].get(tenant, 0)


def test_a_restricted_tenants_bytes_never_cross_a_forbidden_link(
    regions_cluster: LiveCluster, own_engines: None
) -> None:
    """atlantic may use us-east and eu-west only. Its requests reach eu-west over the us-east~eu-west
    link, and its KV is pulled over it, but nothing of it ever goes over a link to ap-south, even
    for a client in ap-south; the default tenant's does, the same way (so the counters do see
    those links). Read from the links' own counters, which parse the traffic they carry."""
    us_east, eu_west = _entry(regions_cluster, 0), _entry(regions_cluster, 1)
    before = _links(regions_cluster)
    _, served_by, _ = _ask(us_east, ATLANTIC_KEY, **{CLIENT_REGION_HEADER: "eu-west"})
    assert served_by == "eu-west"
    _, served_by, _ = _ask(us_east, ATLANTIC_KEY, **{CLIENT_REGION_HEADER: "ap-south"})
    assert served_by in ("us-east", "eu-west")
    _, served_by, _ = _ask(us_east, **{CLIENT_REGION_HEADER: "ap-south"})
    assert served_by == "ap-south"
    # atlantic's KV across us-east~eu-west: a session served in eu-west, whose next turn's
    # advisory finds eu-west's scheduler stopped and goes to us-east, which pulls the history.
    story = " ".join(f"Verse {i}: the tide rose {i} times past stone {i * 3}." for i in range(60))
    messages = [{"role": "user", "content": story + " How many verses?"}]
    known = _regions(regions_cluster, 1)["eu-west"]["sessions_known"]
    _, served_by, _ = _chat_turn(eu_west, "tides", messages, ATLANTIC_KEY)
    assert served_by == "eu-west"
    wait_until(lambda: _regions(regions_cluster, 1)["eu-west"]["sessions_known"] > known, 30, "eu-west's feed")
    pulled = _prefetches_done(regions_cluster)
    with _eu_west_scheduler_stopped(regions_cluster):
        _advise_to_us_east(eu_west, "tides", ATLANTIC_KEY)
        wait_until(lambda: _prefetches_done(regions_cluster) > pulled, 60, "us-east's node to pull atlantic's session")

    latest: list[list[dict[str, Any]]] = []

    def settled() -> bool:  # every byte on the links has its owner (no request is half read)
        latest[:] = [_links(regions_cluster)]
        return not any(PENDING in lane for link in latest[0] for lane in link["tenant_bytes"].values())

    wait_until(settled, 30, "every byte on the links to have its owner")
    after = latest[0]
    atlantic = _owned(after, "eu-west~us-east", "atlantic")  # both lanes, and KV
    assert all(now > then for now, then in zip(atlantic, _owned(before, "eu-west~us-east", "atlantic"), strict=True))
    default = _owned(after, "ap-south~us-east", "default")
    assert sum(default[:2]) > sum(_owned(before, "ap-south~us-east", "default")[:2])
    assert residency_crossings(after, RESIDENCY) == {"atlantic": 0}
    assert residency_crossings(after, RESIDENCY, "tenant_kv_bytes") == {"atlantic": 0}
    for link in after:  # nothing went unread, so the zeros above are not for want of reading
        assert link["sniff_errors"] == 0, link
        for lane, counts in link["tenant_bytes"].items():
            assert not {UNATTRIBUTED, UNKNOWN_KEY, OTHER} & set(counts), (link["pair"], lane, counts)
            assert sum(counts.values()) == link["bytes"][lane], (link["pair"], lane, counts)


def test_killing_a_regions_scheduler_fails_its_traffic_over(regions_cluster: LiveCluster, own_engines: None) -> None:
    os.kill(regions_cluster.scheduler_pid(region="us-east"), signal.SIGKILL)
    # At once: the request is moved on without the client seeing an error.
    text, served_by, _ = _ask(_entry(regions_cluster, 0))
    assert served_by == "eu-west" and "Paris" in text


def _regions(cluster: LiveCluster, index: int) -> dict[str, Any]:
    url = _entry(cluster, index).removesuffix("/v1") + "/regions"
    return httpx.get(url, timeout=5, headers=cluster.internal_headers).json()["regions"]  # type: ignore[no-any-return]


def _chat_turn(url: str, session: str, messages: list[dict[str, str]], key: str = "none") -> tuple[str, str, int]:
    """(answer, serving region, cached prompt tokens) of a greedy turn."""
    reply = httpx.post(
        url + "/chat/completions",
        json={"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 12, "temperature": 0.0},
        headers={"X-Session-ID": session, "Authorization": f"Bearer {key}"},
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    cached = int((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return body["choices"][0]["message"]["content"], reply.headers[REGION_HEADER], cached


def test_an_advisory_moves_kv_out_of_a_region_that_went_down(regions_cluster: LiveCluster, own_engines: None) -> None:
    """A session's first turn runs in eu-west. eu-west's scheduler stops (its node and the KV it
    saved stay up). The advisory of the session's next turn, at eu-west's entry, goes to the next
    region, us-east, whose node pulls the history from eu-west's node over the 75 ms link before
    the turn comes: the turn finds it cached, and answers as a recompute of it does."""
    story = " ".join(f"Chapter {i}: the traveller crossed river {i} and counted {i * 7} stones." for i in range(60))
    messages = [{"role": "user", "content": story + " Summarise the journey."}]
    eu_west = _entry(regions_cluster, 1)
    known = _regions(regions_cluster, 1)["eu-west"]["sessions_known"]
    _, served_by, _ = _chat_turn(eu_west, "travel", messages)
    assert served_by == "eu-west"
    wait_until(lambda: _regions(regions_cluster, 1)["eu-west"]["sessions_known"] > known, 30, "eu-west's feed")
    pulled, moves_in = _prefetches_done(regions_cluster), _regions(regions_cluster, 1)["us-east"]["kv_moves_in"]
    with _eu_west_scheduler_stopped(regions_cluster):
        _advise_to_us_east(eu_west, "travel", "none")
        assert _regions(regions_cluster, 1)["us-east"]["kv_moves_in"] == moves_in + 1
        wait_until(lambda: _prefetches_done(regions_cluster) > pulled, 60, "us-east's node to pull the session")
        follow = [
            *messages,
            {"role": "assistant", "content": "A long walk."},
            {"role": "user", "content": "How many rivers?"},
        ]
        answer, served_by, cached = _chat_turn(eu_west, "travel", follow)
        assert served_by == "us-east"
        assert cached >= 32 * 20, f"only {cached} prompt tokens were cached: the moved KV was not used"
        # The reference: the same turn on eu-west's engine itself, where vLLM's own cache holds turn
        # one's KV (the tenant's salt): the moved pages are those bytes, so the answer is the same.
        engine = f"http://127.0.0.1:{regions_cluster.engine_ports[1]}/v1/chat/completions"
        body = {"model": regions_cluster.model, "messages": follow, "max_tokens": 12, "temperature": 0.0}
        reference = httpx.post(
            engine,
            json={**body, "cache_salt": regions_cluster.cache_salt(DEFAULT_TENANT)},
            timeout=300,
            headers=regions_cluster.engine_headers,
        )
        assert reference.status_code == 200, reference.text
        assert answer == reference.json()["choices"][0]["message"]["content"]
