"""Regions: the `[regions]` configuration, the topology it describes, and the global layer's pure
choice of region (residency first, then the policy)."""

from __future__ import annotations

import pytest

from global_layer.policies import Nearest, RegionRequest, RegionView, rank_regions
from symphony.config import ConfigError, load_config
from symphony.region_load import RegionLoad
from symphony.regions import build_topology, parse_link

THREE = ["us-east:1", "eu-west:2", "ap-south:1"]


def three_regions(**regions: object) -> object:
    return load_config(
        env={},
        overrides={"regions": {"layout": THREE, **regions}, "cluster": {"nodes": 4}, "kv": {"data_plane": "grpc"}},
    )


def test_the_default_matrix_links_the_three_regions() -> None:
    topology = three_regions().topology()  # type: ignore[attr-defined]
    assert topology.names == ("us-east", "eu-west", "ap-south")
    assert topology.rtt_ms("us-east", "eu-west") == 75
    assert topology.rtt_ms("ap-south", "us-east") == 190
    assert topology.rtt_ms("eu-west", "ap-south") == 120
    assert topology.rtt_ms("eu-west", "eu-west") == 1.0  # intra_rtt_ms
    assert topology.shape("us-east", "eu-west").bandwidth_mbps == 1000
    # Nodes are numbered across regions in layout order.
    assert [topology.region_of_node(i) for i in range(4)] == ["us-east", "eu-west", "eu-west", "ap-south"]


def test_a_one_region_cluster_has_no_topology() -> None:
    assert load_config(env={}).topology() is None


def test_the_layout_comes_from_the_environment_too() -> None:
    config = load_config(
        env={
            "SYMPHONY_REGIONS_LAYOUT": "a:1,b:1",
            "SYMPHONY_REGIONS_LINKS": "a~b:30:100:2:0.01",
            "SYMPHONY_CLUSTER_NODES": "2",
            "SYMPHONY_KV_DATA_PLANE": "grpc",
        }
    )
    shape = config.topology().shape("b", "a")  # type: ignore[union-attr]
    assert (shape.rtt_ms, shape.bandwidth_mbps, shape.jitter_ms, shape.loss) == (30, 100, 2, 0.01)


@pytest.mark.parametrize(
    ("regions", "nodes", "message"),
    [
        ({"layout": ["us-east:0"]}, 1, "regions.layout: 'us-east:0' is not"),
        ({"layout": ["US:1"]}, 1, "regions.layout: 'US:1' is not"),
        ({"layout": ["a:1", "a:1"]}, 2, "regions.layout: region 'a' is given twice"),
        ({"layout": ["a:1", "b:1"]}, 2, 'regions.links: no link between a and b: add "a~b:rtt_ms:bandwidth_mbps"'),
        ({"layout": ["a:1", "b:1"], "links": ["a~c:1:1"]}, 2, "names a region not in regions.layout: c"),
        ({"layout": ["a:1", "b:1"], "links": ["a~b:1:1", "b~a:2:2"]}, 2, "a and b are linked twice"),
        ({"layout": ["a:1", "b:1"], "links": ["a~b:10"]}, 2, 'is not "a~b:rtt_ms:bandwidth_mbps'),
        ({"layout": ["a:1", "b:1"], "links": ["a~b:10:0"]}, 2, "bandwidth_mbps must be > 0"),
        ({"layout": ["a:1", "b:1"], "links": ["a~b:10:x"]}, 2, "the figures must be numbers"),
        ({"layout": ["a:1", "b:1"], "links": ["a~b:10:1:6"]}, 2, "jitter_ms must be within"),
        ({"layout": ["a:1", "b:1"], "links": ["a~b:10:1:0:1"]}, 2, "loss must be within"),
        ({"layout": ["us-east:1"], "residency": ["t=eu-west"]}, 1, "tenant 't' is allowed a region not in"),
        ({"layout": ["us-east:1"], "residency": ["t"]}, 1, "regions.residency: 't' is not \"tenant=region|region\""),
        ({"layout": ["us-east:1"], "residency": ["t=us-east", "t=us-east"]}, 1, "tenant 't' is given twice"),
        ({"layout": ["us-east:1"], "residency": ["t=us-east"]}, 1, "tenant 't' has no API key"),
        ({"layout": ["us-east:1"], "intra_rtt_ms": -1}, 1, "regions.intra_rtt_ms"),
        ({"layout": ["us-east:2"]}, 1, "cluster.nodes: 1, but regions.layout places 2 nodes"),
        ({"probe_interval_ms": 0}, 2, "regions.probe_interval_ms: must be positive"),
        ({"probe_interval_ms": 600}, 2, "regions.region_down_after_ms: must be at least"),
    ],
)
def test_bad_regions_name_the_key(regions: dict[str, object], nodes: int, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, overrides={"regions": regions, "cluster": {"nodes": nodes}})
    assert message in str(caught.value)


def test_a_scheduler_serves_its_regions_nodes_on_its_regions_port() -> None:
    config = load_config(
        env={},
        overrides={
            "regions": {"layout": THREE},
            "cluster": {"nodes": 4},
            "scheduler": {"region": "eu-west"},
            "kv": {"data_plane": "grpc"},
        },
    )
    assert config.scheduler_node_addresses() == ["127.0.0.1:50052", "127.0.0.1:50053"]
    assert config.scheduler_listen_port == config.regions.scheduler_port_base + 1
    assert load_config(env={}).scheduler_listen_port == 8000


def test_a_scheduler_region_must_be_in_the_layout() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.region: 'mars' is not in regions\.layout"):
        load_config(
            env={},
            overrides={
                "regions": {"layout": THREE},
                "cluster": {"nodes": 4},
                "scheduler": {"region": "mars"},
                "kv": {"data_plane": "grpc"},
            },
        )
    with pytest.raises(ConfigError, match=r"scheduler\.region: needs regions\.layout"):
        load_config(env={}, overrides={"scheduler": {"region": "us-east"}})


def test_region_ports_may_not_overlap_the_others() -> None:
    # Entries take scheduler.port + r: a scheduler base right above the first entry collides.
    with pytest.raises(ConfigError, match=r"ports: scheduler, node, engine and region ports overlap at \[8001, 8002\]"):
        three_regions(scheduler_port_base=8001)
    with pytest.raises(ConfigError, match=r"overlap at \[8010, 8011, 8012\]"):
        three_regions(link_port_base=8005)  # its listeners reach past 8010, the regional schedulers' ports


def test_the_link_plan_gives_every_ordered_pair_its_own_listener() -> None:
    topology = three_regions().topology()  # type: ignore[attr-defined]
    plan = topology.link_plan(7400)
    # 6 ordered pairs of regions to a scheduler; each region to every node of the others: 3 + 2 + 3.
    assert [p.port for p in plan] == list(range(7401, 7401 + 6 + 8))
    schedulers = [(p.source, p.dest) for p in plan if p.target == "scheduler"]
    assert set(schedulers) == {(a, b) for a in topology.names for b in topology.names if a != b}
    to_nodes = {(p.source, p.target) for p in plan if p.target != "scheduler"}
    assert ("us-east", "node-1") in to_nodes and ("us-east", "node-2") in to_nodes
    assert ("eu-west", "node-1") not in to_nodes  # a region reaches its own nodes directly
    assert len(to_nodes) == 8


def test_parse_link_is_symmetric() -> None:
    pair, shape = parse_link("eu-west~us-east:75:1000")
    assert pair == frozenset({"us-east", "eu-west"}) and shape.one_way_s == 0.0375


# -- the global layer's choice ---------------------------------------------------------------------
LOAD = RegionLoad(ready_nodes=1, idle_nodes=1, running=0, waiting=0, inflight=0, queued=0, kv_usage=0.0)
TOPOLOGY = build_topology(
    THREE,
    ["us-east~eu-west:75:1000", "us-east~ap-south:190:1000", "eu-west~ap-south:120:1000"],
    1.0,
    ["eu-only=eu-west", "asia=ap-south|eu-west"],
)


def views(**up: bool) -> list[RegionView]:
    return [RegionView(name, up.get(name.replace("-", "_"), True), LOAD) for name in TOPOLOGY.names]


def test_nearest_goes_home_then_by_round_trip() -> None:
    assert rank_regions(Nearest(), RegionRequest("t", "ap-south"), views(), TOPOLOGY).regions == [
        "ap-south",
        "eu-west",
        "us-east",
    ]
    assert rank_regions(Nearest(), RegionRequest("t", "us-east"), views(), TOPOLOGY).regions == [
        "us-east",
        "eu-west",
        "ap-south",
    ]


def test_a_down_region_is_not_tried() -> None:
    ranking = rank_regions(Nearest(), RegionRequest("t", "us-east"), views(us_east=False), TOPOLOGY)
    assert ranking.regions == ["eu-west", "ap-south"]


def test_residency_drops_forbidden_regions_before_the_policy() -> None:
    ranking = rank_regions(Nearest(), RegionRequest("eu-only", "us-east"), views(), TOPOLOGY)
    assert ranking.regions == ["eu-west"]
    assert ranking.forbidden_up == ["us-east", "ap-south"]
    # Whatever the policy would prefer, it never sees a forbidden region.
    seen: list[str] = []

    class Greedy(Nearest):
        def rank(self, request: RegionRequest, candidates: object, topology: object) -> list[str]:  # type: ignore[override]
            seen.extend(v.name for v in candidates)  # type: ignore[attr-defined]
            return ["us-east"]

    rank_regions(Greedy(), RegionRequest("asia", "us-east"), views(), TOPOLOGY)
    assert sorted(seen) == ["ap-south", "eu-west"]


def test_residency_with_its_regions_down_leaves_nowhere() -> None:
    ranking = rank_regions(Nearest(), RegionRequest("eu-only", "eu-west"), views(eu_west=False), TOPOLOGY)
    assert ranking.regions == [] and ranking.forbidden_up == ["us-east", "ap-south"]


def test_a_region_summary_round_trips_and_refuses_junk() -> None:
    assert RegionLoad.from_json(LOAD.to_json()) == LOAD
    for bad in (
        {},
        {**LOAD.to_json(), "running": -1},
        {**LOAD.to_json(), "queued": "3"},
        {**LOAD.to_json(), "waiting": True},
    ):
        with pytest.raises(ValueError, match="summary field"):
            RegionLoad.from_json(bad)


def test_node_names_take_ascii_digits_only() -> None:
    from symphony.regions import node_index

    assert node_index("node-12") == 12
    for name in ("node-\xb2", "node-", "nodes-1", "node-1a", "scheduler"):
        assert node_index(name) is None
