"""`symphony status`: the cluster as its scheduler sees it; for a multi-region cluster, the global
layer's regions, the WAN links between them, and each region's scheduler."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import httpx

from symphony.cli_args import CliError, load_from_args
from symphony.config import SymphonyConfig
from symphony.config_secrets import ADMIN_TOKEN_ENV, SECRET_FILE, home_secret
from symphony.regions import RegionTopology
from symphony.tenancy import internal_headers


def show_status(args: argparse.Namespace) -> int:
    config = load_from_args(args)
    headers = _credentials(config, args.url)
    topology = config.topology()
    if topology is not None and not args.url:
        return _region_status(config, topology, args.json, headers)
    # With replicas (scheduler.replicas), the first that answers is shown whole, the others a line each.
    urls = [(args.url or config.scheduler_url).rstrip("/")]
    if not args.url:
        urls = [f"http://{config.scheduler.host}:{config.scheduler.port + i}" for i in range(config.scheduler.replicas)]
    answers = [_try_json(url + "/readyz", headers) if len(urls) > 1 else None for url in urls]
    shown = next((i for i, answer in enumerate(answers) if isinstance(answer, dict)), 0)
    url = urls[shown]
    body = _get_json(url + "/readyz", "the scheduler", headers)
    if isinstance(body, dict) and "nodes" not in body:  # keys are set and no token read the details
        raise CliError(
            f"the scheduler at {url} shows its details to the admin token only: set {ADMIN_TOKEN_ENV} "
            f"(it reports {body.get('status')}, {body.get('ready_nodes')} ready node(s))"
        )
    if args.json:
        print(json.dumps(body, indent=2))
        return 0 if body.get("status") == "ready" else 1
    _print_scheduler(url, body)
    for i, (replica, answer) in enumerate(zip(urls, answers, strict=True)):
        if i != shown:
            said = (
                f"{answer.get('status')} ({answer.get('ready_nodes')} ready)"
                if isinstance(answer, dict)
                else "not answering"
            )
            print(f"replica {i} {replica}: {said}")
    return 0 if body.get("status") == "ready" else 1


def _credentials(config: SymphonyConfig, url: str | None) -> dict[str, str]:
    """What reads the details once keys are set: the admin token from `$SYMPHONY_ADMIN_TOKEN` if
    given, else the cluster's internal token (`symphony.tenancy`), sent only to the configured
    cluster's own addresses (never to another `--url`) and only from a secret that exists: this
    command makes none."""
    token = os.environ.get(ADMIN_TOKEN_ENV, "").strip()
    if token:
        return {"Authorization": f"Bearer {token}"}
    secret = config.cluster.secret
    path = config.home_path / SECRET_FILE
    if not secret and not url and path.exists():
        try:
            secret = home_secret(path)
        except (OSError, ValueError) as exc:
            raise CliError(f"cluster.secret: {exc}") from None
    return internal_headers(secret) if secret and not url else {}


def _get_json(url: str, what: str, headers: dict[str, str]) -> Any:
    try:
        body = httpx.get(url, timeout=5.0, headers=headers).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise CliError(f"cannot reach {what} at {url}: {exc}") from None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):  # refused: say why rather than print an empty cluster
        raise CliError(f"{what} at {url} refused: {error.get('message')} (set {ADMIN_TOKEN_ENV} to the admin token)")
    return body


def _region_status(config: SymphonyConfig, topology: RegionTopology, as_json: bool, headers: dict[str, str]) -> int:
    """A multi-region cluster: the global layer's view from the first region's entry, the WAN
    links, and each region's scheduler. A part that does not answer is shown as such."""
    host = config.scheduler.host
    entry = _try_json(config.scheduler_url + "/regions", headers)
    links = _try_json(f"http://{host}:{config.regions.link_port_base}/links", headers)
    schedulers = {}
    for region in topology.regions:
        url = f"http://{host}:{config.regions.scheduler_port_base + region.index}"
        schedulers[region.name] = (url, _try_json(url + "/readyz", headers))
    ready = entry is not None and all(b is not None and b.get("status") == "ready" for _, b in schedulers.values())
    if as_json:
        body = {"global": entry, "links": links, "schedulers": {n: b for n, (_, b) in schedulers.items()}}
        print(json.dumps(body, indent=2))
        return 0 if ready else 1
    if entry is None:
        print(f"global layer {config.scheduler_url}: not answering")
    else:
        print(f"global layer {config.scheduler_url} (entry {entry.get('entry')}): policy {entry.get('policy')}")
        for name, info in entry.get("regions", {}).items():
            load = info.get("load") or {}
            print(
                f"  region {name:<10} {'up' if info['up'] else 'DOWN':<4} rtt {info['rtt_ms']:g} ms  "
                f"entry :{config.scheduler.port + topology.region(name).index}  "
                f"ready={load.get('ready_nodes', 0)}/{len(topology.region(name).nodes)} "
                f"running={load.get('running', 0)} waiting={load.get('waiting', 0)} queued={load.get('queued', 0)} "
                f"served={info['served']} failovers={info['failovers']}"
            )
        if entry.get("refusals"):
            print("  refused: " + ", ".join(f"{k}={v}" for k, v in sorted(entry["refusals"].items())))
    if links is None:
        print(f"  links :{config.regions.link_port_base}: not answering")
    for line in describe_region_links((links or {}).get("links", [])):
        print(line)
    for tenant, allowed in sorted(topology.residency.items()):
        print(f"  residency (configured): tenant {tenant} stays in {', '.join(sorted(allowed))}")
    for name, (url, body) in schedulers.items():
        print(f"[{name}] ", end="")
        if body is None:
            print(f"scheduler {url}: not answering")
        else:
            _print_scheduler(url, body)
    return 0 if ready else 1


def _try_json(url: str, headers: dict[str, str]) -> Any:
    """The JSON body at `url`; None when nothing answers or it refused (an error body)."""
    try:
        body = httpx.get(url, timeout=5.0, headers=headers).json()
    except (httpx.HTTPError, ValueError):
        return None
    return None if isinstance(body, dict) and isinstance(body.get("error"), dict) else body


def describe_region_links(links: list[dict[str, Any]]) -> list[str]:
    """The WAN links' `GET /links` (symphony.region_links), a line each."""
    lines = []
    for link in links:
        fault = "" if link["fault"] == "none" else f"  FAULT {link['fault']}"
        if link.get("extra_latency_ms"):
            fault += f" +{link['extra_latency_ms']:g} ms"
        moved = ", ".join(f"{lane} {_bytes(n)}" for lane, n in sorted(link["bytes"].items()))
        lines.append(
            f"  link {link['pair']:<20} rtt {link['rtt_ms']:g} ms  {link['bandwidth_mbps']:g} Mb/s  "
            f"jitter {link['jitter_ms']:g} ms  loss {link['loss']:g}  open {link['open']}  {moved}{fault}"
        )
        owners = _tenant_line(link)
        if owners:
            lines.append(owners)
    return lines


STATUS_TENANTS = 4  # a link's biggest owners of bytes printed (--json has every label, per lane)


def _tenant_line(link: dict[str, Any]) -> str:
    """Whose a link's bytes were, both lanes together, biggest first ("" from links without it)."""
    totals: dict[str, int] = {}
    for counts in link.get("tenant_bytes", {}).values():
        for label, n in counts.items():
            totals[label] = totals.get(label, 0) + n
    if not totals:
        return ""
    ranked = sorted(totals.items(), key=lambda item: (-item[1], item[0]))
    shown = ", ".join(f"{label} {_bytes(n)}" for label, n in ranked[:STATUS_TENANTS])
    more = f" (+{len(ranked) - STATUS_TENANTS} more)" if len(ranked) > STATUS_TENANTS else ""
    errors = f"  unread connections {link['sniff_errors']}" if link.get("sniff_errors") else ""
    return f"    by owner: {shown}{more}{errors}"


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _print_scheduler(url: str, body: dict[str, Any]) -> None:
    print(f"scheduler {url}: {body.get('status')} ({body.get('ready_nodes')} ready)")
    for name, info in sorted(body.get("nodes", {}).items()):
        print(
            f"  {name:<8} {info['state']:<18} running={info['running']} waiting={info['waiting']} "
            f"inflight={info['inflight']} kv={info['kv_cache_usage']:.1%} "
            f"of {info.get('kv_cache_tokens') or '?'} tokens "
            f"restarts={info['engine_restarts']} "
            f"model={info.get('model') or '-'}@{info.get('model_fingerprint') or '-'}{_kv_index_text(info)}"
            + ("  ANOTHER cluster.secret (its engine's blocks go unseen)" if info.get("same_secret") is False else "")
        )
    coordination = body.get("coordination")
    if isinstance(coordination, dict):
        error = coordination.get("membership_error")
        print(
            f"  etcd {','.join(coordination.get('etcd', []))}: "
            f"{len(coordination.get('members_joined', []))} member(s) joined"
            + (f", NOT READ: {error}" if error else "")
            + f"; admin changes from replicas applied: {coordination.get('control_changes_applied')}"
        )
    profile = body.get("cost_profile")
    if profile:
        print(_describe_profile(profile))
    for line in _describe_links(body.get("observed_links", [])):
        print(line)


MAX_STATUS_LINKS = 16  # observed node pairs printed; a fleet's can run to thousands (--json has all)


def _kv_index_text(info: dict[str, Any]) -> str:
    """The node's cluster KV index state in `symphony status` ("" from a scheduler without one)."""
    kv = info.get("kv_index")
    if not isinstance(kv, dict):
        return ""
    state = f"fallback({kv.get('state')})" if kv.get("fallback") else kv.get("state")
    return f" index={state} lag={kv.get('lag_ms', 0):.0f}ms resyncs={kv.get('resyncs', 0)}"


def _describe_links(links: list[dict[str, Any]]) -> list[str]:
    """/readyz's `observed_links` (scheduler.pull_costs.ObservedLink), a line each, the first
    `MAX_STATUS_LINKS` of them."""
    lines = []
    for link in links[:MAX_STATUS_LINKS]:
        priced = "" if link["priced"] else ", not priced yet"
        lines.append(
            f"  pulls {link['source']} -> {link['target']}: {link['ms_per_token']:.3f} ms/token over "
            f"{link['pulls']} pulls (calibrated {link['calibrated_ms_per_token']:.3f}){priced}"
        )
    if len(links) > MAX_STATUS_LINKS:
        lines.append(f"  ... and {len(links) - MAX_STATUS_LINKS} more observed links (symphony status --json)")
    return lines


def _describe_profile(p: dict[str, Any]) -> str:
    """/readyz's `cost_profile` (scheduler.profile_loader.LoadedProfile.describe) in a few lines."""
    if p["status"] == "loaded":
        measured = time.strftime("%Y-%m-%d %H:%M", time.localtime(p["measured_at_unix_s"]))
        head = f"cost profile {p['path']}: measured {measured} on {p['host']} with {p['model']}"
    else:
        head = f"cost profile {p['path']}: {p['status']} ({p['problem']}); routing on built-in defaults"
    tiers = p["tier_load_us_per_token"]
    link = p["default_link"]
    return (
        f"{head}\n  prefill {p['prefill_ms_1k_tokens']:.0f} ms per 1k tokens, request overhead "
        f"{p['request_overhead_ms']:.0f} ms, decode step {p['decode_step_ms']['fixed']:.1f} ms + "
        f"{p['decode_step_ms']['per_seq']:.2f} ms/request\n  load us/token: hbm {tiers['hbm']:.2f}, "
        f"dram {tiers['dram']:.2f}, ssd {tiers['ssd']:.2f}; links: {p['links']} measured, default "
        f"{link['rtt_ms']:.2f} ms RTT at {link['bandwidth_gbps']:.2f} GB/s"
    )
