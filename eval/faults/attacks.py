"""Scenario 4 of the fault suite: calls a cluster must refuse, made while the chat load runs.

Each attempt says what an attacker tried and whether it got past authentication
(`unauthorized_accepted` counts those): an HTTP answer other than 401/403, a gRPC call the server
handled (any code but those of a refused handshake), or any frame back from a page stream. An
attempt whose listener did not answer at all proved nothing and is listed as `unreachable`.

Listeners tried: every node's gRPC (plaintext; TLS with no client certificate; a certificate of
another CA), each with GetStoreInfo, a victim's session status, `WritePages` over the victim and a
`Pull` naming an attacker's "peer"; every node's page stream (plaintext and another CA's
certificate, asking for the victim's session); every engine's HTTP API (no key, a wrong key, on
`/v1/chat/completions`, `/invocations` and `/tokenize`); and every scheduler replica (chat,
`/metrics` and the admin API with no key and a wrong one, `/readyz` details with none). Tenancy:
another tenant's key with the victim's session name, its history and forged `kv_transfer_params`
naming it; accepted if the answer had any of that history from a cache (the attacker sent nothing
before, so under its own salt nothing of it could be cached). The victim is a live session of the
load: its next turn, sent after the attacks, is checked against its recompute reference, so an
attack that poisoned its KV shows as a wrong output. Listeners left out, and why: `NOT_ATTACKED`.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx

from node_manager.kv.page_stream import ProtocolError, _read_session, _send_request
from symphony.cluster_tls import ClusterTLS, init_ca, issue_member, load_tls
from symphony.kv_transfer import SESSION_PARAM, TENANT_PARAM
from symphony.rpc import kv_pb2, kv_pb2_grpc

CALL_TIMEOUT_S = 5.0


@dataclass
class Attempt:
    """One attack. `accepted`: it got past authentication (whatever the call then answered);
    `unreachable`: the listener did not answer at all, so the attempt proved nothing."""

    listener: str
    attack: str
    accepted: bool
    detail: str = ""
    unreachable: bool = False


# gRPC codes a call gets when the channel never got through the TLS handshake (or was refused it).
REFUSED_CODES = frozenset({"UNAVAILABLE", "UNAUTHENTICATED", "PERMISSION_DENIED"})
REFUSED_HTTP = frozenset({401, 403})


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
    scheduler_urls: list[str]  # every replica
    model: str
    attacker_key: str  # a tenant's own API key: a tenant, but not the victim's
    fingerprint: bytes
    member_tls: ClusterTLS | None


def foreign_tls(directory: Path) -> ClusterTLS:
    """A CA of its own and a member certificate it signed: another cluster's credentials."""
    init_ca(directory)
    issue_member(directory, "member", ["127.0.0.1"], cert_name="member.pem", key_name="member.key")
    return load_tls(directory)


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address)


def no_client_cert_channel(address: str, member: ClusterTLS | None) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(root_certificates=member.ca if member else None)
    return grpc.aio.secure_channel(address, credentials)


def foreign_channel(address: str, foreign: ClusterTLS, member: ClusterTLS | None) -> grpc.aio.Channel:
    # Trusting the cluster's CA (an attacker can read it off any handshake), presenting its own.
    credentials = grpc.ssl_channel_credentials(
        root_certificates=member.ca if member else foreign.ca, private_key=foreign.key, certificate_chain=foreign.cert
    )
    return grpc.aio.secure_channel(address, credentials)


async def grpc_attempts(address: str, channel: grpc.aio.Channel, how: str, victim: Victim) -> list[Attempt]:
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
    # A call the server handled (OK, or any code but the refusals) means the channel got through;
    # then every call on it did, whatever each answered (a Pull to a dead peer answers UNAVAILABLE too).
    answers = []
    async with channel:
        for name, call in calls:
            try:
                await call()
                answers.append((name, "OK"))
            except grpc.aio.AioRpcError as exc:
                answers.append((name, exc.code().name))
    through = any(code not in REFUSED_CODES for _, code in answers)
    return [Attempt(f"node gRPC {address}", f"{name} ({how})", through, code) for name, code in answers]


def page_stream_attempt(
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
            status, reason = _read_session(sock)
            # Any frame back (a session status, or an END naming why not) means it got through.
            return Attempt(listener, f"session of a victim ({how})", True, "a session status" if status else reason)
    except ConnectionRefusedError as exc:
        return Attempt(listener, f"session of a victim ({how})", False, repr(exc), unreachable=True)
    except (OSError, ValueError, ProtocolError) as exc:  # closed, reset, a failed handshake: no frame
        return Attempt(listener, f"session of a victim ({how})", False, type(exc).__name__)


async def _http_attempt(
    client: httpx.AsyncClient, listener: str, attack: str, method: str, url: str, **kwargs: Any
) -> Attempt:
    try:
        reply = await client.request(method, url, timeout=CALL_TIMEOUT_S * 6, **kwargs)
    except httpx.HTTPError as exc:
        return Attempt(listener, attack, False, type(exc).__name__, unreachable=True)
    # Only a refusal is a refusal: a 400 or a 404 came from past the authentication.
    return Attempt(listener, attack, reply.status_code not in REFUSED_HTTP, str(reply.status_code))


async def run_attacks(targets: AttackTargets, victim: Victim) -> list[Attempt]:
    """Every attempt of the module docstring against `targets`, naming `victim`."""
    attempts: list[Attempt] = []
    with tempfile.TemporaryDirectory(prefix="symphony-attacker-") as scratch:
        foreign = foreign_tls(Path(scratch) / "ca")
        member = targets.member_tls
        for address in targets.node_grpc:
            for how, channel in (
                ("plaintext", insecure_channel(address)),
                ("TLS, no client certificate", no_client_cert_channel(address, member)),
                ("another CA's certificate", foreign_channel(address, foreign, member)),
            ):
                attempts += await grpc_attempts(address, channel, how, victim)
        foreign_context = foreign.client_context()
        foreign_context.check_hostname = False
        foreign_context.verify_mode = ssl.CERT_NONE  # an attacker does not care whom it talks to
        for port in targets.node_data_ports:
            for how, context in (("plaintext", None), ("another CA's certificate", foreign_context)):
                attempts.append(
                    await asyncio.to_thread(page_stream_attempt, port, how, context, victim, targets.fingerprint)
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
        for s in targets.scheduler_urls:
            listener = f"scheduler {s}"
            for how, headers in (("no key", {}), ("a wrong key", {"Authorization": "Bearer not-a-tenant-key"})):
                calls: tuple[tuple[str, str, dict[str, object] | None], ...] = (
                    ("POST", "/v1/chat/completions", chat),
                    ("GET", "/metrics", None),
                    ("GET", "/admin/v1/priorities", None),
                )
                for method, path, payload in calls:
                    attempts.append(
                        await _http_attempt(
                            client,
                            listener,
                            f"{method} {path} ({how})",
                            method,
                            s + path,
                            json=payload,
                            headers=headers,
                        )
                    )
            attempts.append(await _readyz_details(client, s))
        attempts.append(await _cross_tenant(client, targets, victim))
    return attempts


async def _readyz_details(client: httpx.AsyncClient, scheduler_url: str) -> Attempt:
    try:
        reply = await client.get(scheduler_url + "/readyz", timeout=CALL_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return Attempt(f"scheduler {scheduler_url}", "GET /readyz details (no token)", False, repr(exc), True)
    try:
        body = reply.json()
    except ValueError:
        body = None
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
    url = targets.scheduler_urls[0]
    listener = f"scheduler {url}"
    attack = "another tenant's key with a victim's session, history and forged kv_transfer_params"
    try:
        reply = await client.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    except httpx.HTTPError as exc:
        return Attempt(listener, attack, False, repr(exc), unreachable=True)
    if reply.status_code != 200:
        return Attempt(listener, attack, False, str(reply.status_code))
    try:
        usage = reply.json().get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return Attempt(listener, attack, False, "200 with no usage to read", unreachable=True)
    return Attempt(listener, attack, cached > 0, f"200 with {cached} cached tokens")


# Listeners a cluster like the bench's has that no attempt is made on, and why: in the report.
NOT_ATTACKED = {
    "etcd client port": "plaintext, no authentication: bound to loopback only by `symphony up --ha` "
    "(symphony/launcher.py); a multi-host etcd is the operator's, with its own TLS",
    "node KV metrics ports": "Prometheus text of tier sizes and counters, no tenant data; not yet authenticated",
}


def summary(attempts: Sequence[Attempt]) -> dict[str, Any]:
    return {
        "attempts": len(attempts),
        "unauthorized_accepted": sum(1 for a in attempts if a.accepted),
        "accepted": [f"{a.listener}: {a.attack} ({a.detail})" for a in attempts if a.accepted],
        "unreachable": [f"{a.listener}: {a.attack} ({a.detail})" for a in attempts if a.unreachable],
        "listeners": sorted({a.listener for a in attempts}),
        "not_attacked": NOT_ATTACKED,
    }
