"""Scenario 4 of the fault suite: calls a cluster must refuse, made while the chat load runs.

Each attempt says what an attacker tried and whether the cluster accepted it
(`unauthorized_accepted` counts those). The victims are the load's own live sessions: a
cross-tenant call names one of them, and the load goes on checking every answer of theirs against
its recompute reference, so an attack that poisoned a victim's KV shows as a wrong output there.

Listeners tried: every node's gRPC (plaintext; TLS with no client certificate; a certificate of
another CA, also sending `WritePages` and a `Pull` that names an attacker's "peer"), every node's
page stream (plaintext and another CA's certificate, asking for a victim's session), every
engine's HTTP API (no key, a wrong key, on `/v1`, `/invocations` and `/tokenize`), and the
scheduler (no API key, a wrong one, `/metrics`, `/readyz` details and the admin API without their
tokens). Tenancy: another tenant's key with a victim's session name, its history, and forged
`kv_transfer_params` naming the victim; at the scheduler, the answer must show no cached token
(the victim's KV would be the only cached copy of that history under the attacker's salt).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from node_manager.kv.page_stream import _read_session, _send_request
from symphony.cluster_tls import ClusterTLS, init_ca, issue_member, load_tls
from symphony.kv_transfer import SESSION_PARAM, TENANT_PARAM
from symphony.rpc import kv_pb2, kv_pb2_grpc

CALL_TIMEOUT_S = 5.0


@dataclass
class Attempt:
    listener: str
    attack: str
    accepted: bool
    detail: str = ""


@dataclass
class Victim:
    tenant: str
    session: str
    messages: list[dict[str, str]]


@dataclass
class AttackTargets:
    node_grpc: list[str]
    node_data_ports: list[int]
    engine_urls: list[str]
    scheduler_url: str
    model: str
    attacker_key: str  # a tenant's own API key: a tenant, but not the victim's
    fingerprint: bytes
    member_tls: ClusterTLS | None
    attempts: list[Attempt] = field(default_factory=list)


def foreign_tls(directory: Path) -> ClusterTLS:
    """A CA of its own and a member certificate it signed: another cluster's credentials."""
    init_ca(directory)
    issue_member(directory, "member", ["127.0.0.1"], cert_name="member.pem", key_name="member.key")
    return load_tls(directory)


def _insecure(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address)


def _no_client_cert(address: str, member: ClusterTLS | None) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(root_certificates=member.ca if member else None)
    return grpc.aio.secure_channel(address, credentials)


def _foreign(address: str, foreign: ClusterTLS, member: ClusterTLS | None) -> grpc.aio.Channel:
    # Trusting the cluster's CA (an attacker can read it off any handshake), presenting its own.
    credentials = grpc.ssl_channel_credentials(
        root_certificates=member.ca if member else foreign.ca, private_key=foreign.key, certificate_chain=foreign.cert
    )
    return grpc.aio.secure_channel(address, credentials)


async def _grpc_attempts(
    address: str, channel: grpc.aio.Channel, how: str, victim: Victim, fingerprint: bytes
) -> list[Attempt]:
    stub = kv_pb2_grpc.KVStoreStub(channel)
    ref = kv_pb2.SessionRef(tenant=victim.tenant, session_id=victim.session)
    calls: list[tuple[str, Any]] = [
        ("GetStoreInfo", lambda: stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=CALL_TIMEOUT_S)),
        (
            "GetSessionStatus of a victim",
            lambda: stub.GetSessionStatus(
                kv_pb2.SessionStatusRequest(session=ref, include_token_ids=True), timeout=CALL_TIMEOUT_S
            ),
        ),
        (
            "WritePages over a victim",
            lambda: stub.WritePages(
                iter([kv_pb2.PageBatch(session=ref, layer=0, first_block=0, checksums=[0], data=b"\0" * 64)]),
                timeout=CALL_TIMEOUT_S,
            ),
        ),
        (
            "Pull of a victim from an attacker's peer",
            lambda: stub.Pull(kv_pb2.PullRequest(session=ref, peer="127.0.0.1:9"), timeout=CALL_TIMEOUT_S),
        ),
    ]
    found = []
    async with channel:
        for name, call in calls:
            try:
                await call()
                found.append(Attempt(f"node gRPC {address}", f"{name} ({how})", True, "answered"))
            except grpc.aio.AioRpcError as exc:
                found.append(Attempt(f"node gRPC {address}", f"{name} ({how})", False, exc.code().name))
    return found


def _page_stream_attempt(
    port: int, how: str, context: ssl.SSLContext | None, victim: Victim, fingerprint: bytes
) -> Attempt:
    listener = f"page stream 127.0.0.1:{port}"
    request = kv_pb2.FetchPagesRequest(
        session=kv_pb2.SessionRef(tenant=victim.tenant, session_id=victim.session),
        with_session=True,
        model_fingerprint=fingerprint,
    )
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT_S) as raw:
            sock = context.wrap_socket(raw, server_hostname="127.0.0.1") if context is not None else raw
            sock.settimeout(CALL_TIMEOUT_S)
            _send_request(sock, request)
            status, _ = _read_session(sock)
            return Attempt(
                listener,
                f"session of a victim ({how})",
                status is not None,
                "a session status" if status else "refused",
            )
    except (OSError, ValueError) as exc:  # closed, reset, a failed handshake, or a malformed frame
        return Attempt(listener, f"session of a victim ({how})", False, type(exc).__name__)


async def _http_attempt(
    client: httpx.AsyncClient, listener: str, attack: str, method: str, url: str, **kwargs: Any
) -> Attempt:
    try:
        reply = await client.request(method, url, timeout=CALL_TIMEOUT_S * 6, **kwargs)
    except httpx.HTTPError as exc:
        return Attempt(listener, attack, False, type(exc).__name__)
    return Attempt(listener, attack, 200 <= reply.status_code < 300, str(reply.status_code))


async def run_attacks(targets: AttackTargets, victim: Victim) -> list[Attempt]:
    """Every attempt of the module docstring against `targets`, naming `victim`."""
    attempts: list[Attempt] = []
    with tempfile.TemporaryDirectory(prefix="symphony-attacker-") as scratch:
        foreign = foreign_tls(Path(scratch) / "ca")
        member = targets.member_tls
        for address in targets.node_grpc:
            for how, channel in (
                ("plaintext", _insecure(address)),
                ("TLS, no client certificate", _no_client_cert(address, member)),
                ("another CA's certificate", _foreign(address, foreign, member)),
            ):
                attempts += await _grpc_attempts(address, channel, how, victim, targets.fingerprint)
        foreign_context = foreign.client_context()
        foreign_context.check_hostname = False
        foreign_context.verify_mode = ssl.CERT_NONE  # an attacker does not care whom it talks to
        for port in targets.node_data_ports:
            for how, context in (("plaintext", None), ("another CA's certificate", foreign_context)):
                attempts.append(
                    await asyncio.to_thread(_page_stream_attempt, port, how, context, victim, targets.fingerprint)
                )
    chat = {"model": targets.model, "messages": victim.messages, "max_tokens": 2}
    async with httpx.AsyncClient() as client:
        for url in targets.engine_urls:
            for how, headers in (("no key", {}), ("a wrong key", {"Authorization": "Bearer not-the-engine-key"})):
                for path, body in (("/v1/chat/completions", chat), ("/invocations", chat), ("/tokenize", chat)):
                    attempts.append(
                        await _http_attempt(
                            client,
                            f"engine {url}",
                            f"POST {path} ({how})",
                            "POST",
                            url + path,
                            json=body,
                            headers=headers,
                        )
                    )
        s = targets.scheduler_url
        for how, headers in (("no key", {}), ("a wrong key", {"Authorization": "Bearer not-a-tenant-key"})):
            attempts.append(
                await _http_attempt(
                    client,
                    f"scheduler {s}",
                    f"chat ({how})",
                    "POST",
                    s + "/v1/chat/completions",
                    json=chat,
                    headers=headers,
                )
            )
            attempts.append(
                await _http_attempt(
                    client, f"scheduler {s}", f"GET /metrics ({how})", "GET", s + "/metrics", headers=headers
                )
            )
            attempts.append(
                await _http_attempt(
                    client,
                    f"scheduler {s}",
                    f"GET /admin/v1/priorities ({how})",
                    "GET",
                    s + "/admin/v1/priorities",
                    headers=headers,
                )
            )
        attempts.append(await _readyz_details(client, s))
        attempts.append(await _cross_tenant(client, targets, victim))
    return attempts


async def _readyz_details(client: httpx.AsyncClient, scheduler_url: str) -> Attempt:
    try:
        reply = await client.get(scheduler_url + "/readyz", timeout=CALL_TIMEOUT_S)
        body = reply.json()
    except (httpx.HTTPError, ValueError) as exc:
        return Attempt(f"scheduler {scheduler_url}", "GET /readyz details (no token)", False, type(exc).__name__)
    shown = isinstance(body, dict) and "nodes" in body
    return Attempt(
        f"scheduler {scheduler_url}",
        "GET /readyz details (no token)",
        shown,
        f"{reply.status_code}, nodes shown: {shown}",
    )


async def _cross_tenant(client: httpx.AsyncClient, targets: AttackTargets, victim: Victim) -> Attempt:
    """Another tenant's key, the victim's session name and history, and forged params naming it:
    accepted when the answer had any of that history from a cache."""
    body = {
        "model": targets.model,
        "messages": victim.messages,
        "max_tokens": 2,
        "kv_transfer_params": {TENANT_PARAM: victim.tenant, SESSION_PARAM: victim.session},
    }
    headers = {"Authorization": f"Bearer {targets.attacker_key}", "X-Session-ID": victim.session}
    listener = f"scheduler {targets.scheduler_url}"
    attack = "another tenant's key with a victim's session, history and forged kv_transfer_params"
    try:
        reply = await client.post(
            targets.scheduler_url + "/v1/chat/completions", json=body, headers=headers, timeout=120
        )
    except httpx.HTTPError as exc:
        return Attempt(listener, attack, False, type(exc).__name__)
    if reply.status_code != 200:
        return Attempt(listener, attack, False, str(reply.status_code))
    usage = reply.json().get("usage") or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Attempt(listener, attack, cached > 0, f"200 with {cached} cached tokens")


def summary(attempts: Sequence[Attempt]) -> dict[str, Any]:
    return {
        "attempts": len(attempts),
        "unauthorized_accepted": sum(1 for a in attempts if a.accepted),
        "accepted": [f"{a.listener}: {a.attack} ({a.detail})" for a in attempts if a.accepted],
        "listeners": sorted({a.listener for a in attempts}),
    }
