"""Two real node-manager processes (`symphony node`, engine disabled) with `cluster.tls` on: their
gRPC and page streams take the cluster's members only. A member uploads a session and has the
other node pull it (page stream, then gRPC); plaintext, a client without a certificate and one of
another cluster's CA are refused; a "peer" that is no member gives a node nothing."""

from __future__ import annotations

import asyncio
import json
import os
import random
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from eval.faults.attacks import (
    Victim,
    foreign_channel,
    foreign_tls,
    grpc_attempts,
    insecure_channel,
    no_client_cert_channel,
    page_stream_attempt,
)
from node_manager.kv.pages import PageMac
from node_manager.kv.transfer import page_batch
from symphony.cluster_tls import ClusterTLS, add_port, ensure_tls, grpc_channel, load_tls
from symphony.config_secrets import new_cluster_secret
from symphony.kv_addressing import ModelFingerprint, chain_block_keys
from symphony.kv_geometry import KVGeometry, hf_config_for
from symphony.rpc import kv_pb2, kv_pb2_grpc
from tests.helpers import async_wait_until, free_port_run

GEOMETRY = KVGeometry(num_layers=4, kv_heads=3, head_size=64, block_size=32)
SECRET = new_cluster_secret()
BLOCKS = 6


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two TLS nodes on one home: the first to start makes the CA and member certificate there."""
    home = tmp_path_factory.mktemp("tls-home")
    model = home / "tiny-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(hf_config_for(GEOMETRY)))
    (model / "model.safetensors").write_bytes(b"")
    grpc_base = free_port_run(2)
    config = home / "symphony.toml"
    config.write_text(
        f'home = "{home}"\n[cluster]\nnodes = 2\ntls = true\nsecret = "{SECRET}"\n'
        f"[node]\ngrpc_port_base = {grpc_base}\nengine_port_base = {free_port_run(2)}\n"
        f'[engine]\nenabled = false\nmodel = "{model}"\n'
        f"[kv]\nhbm_bytes = {8 << 20}\ndram_bytes = {16 << 20}\nssd_bytes = {64 << 20}\nmetrics_port_base = 0\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")}
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "node", "--config", str(config), "--index", str(i)],
            stdout=(home / f"node-{i}.out").open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        for i in range(2)
    ]
    try:
        yield [f"127.0.0.1:{grpc_base}", f"127.0.0.1:{grpc_base + 1}", str(home / "tls")]
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
async def member(nodes: list[str]) -> AsyncIterator[tuple[ClusterTLS, list[kv_pb2_grpc.KVStoreStub], list[str]]]:
    """The test as a member (the cluster's own credentials), once both nodes serve."""
    tls_dir = Path(nodes[-1])
    addresses = nodes[:2]
    await async_wait_until(lambda: (tls_dir / "member.pem").exists(), 60, "a node to make the cluster's certificates")
    tls = load_tls(tls_dir)
    channels = [grpc_channel(address, tls) for address in addresses]
    stubs = [kv_pb2_grpc.KVStoreStub(channel) for channel in channels]

    async def serving() -> bool:
        try:
            for stub in stubs:
                await stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=1)
            return True
        except grpc.aio.AioRpcError:
            return False

    await async_wait_until(serving, 60, "both TLS nodes to serve their members", interval_s=0.25)
    yield tls, stubs, addresses
    for channel in channels:
        await channel.close()


async def _upload(stub: kv_pb2_grpc.KVStoreStub, session: str) -> kv_pb2.SessionRef:
    ref = kv_pb2.SessionRef(tenant="acme", session_id=session)
    rng = random.Random(session)
    token_ids = [rng.randrange(49152) for _ in range(BLOCKS * GEOMETRY.block_size)]
    await stub.PutSession(kv_pb2.PutSessionRequest(session=ref, token_ids=token_ids), timeout=10)
    info = await stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=10)
    keys = chain_block_keys(ModelFingerprint(info.model_fingerprint), "acme", token_ids, GEOMETRY.block_size).block_keys
    mac = PageMac(SECRET.encode())
    batches = [
        page_batch(mac, ref, keys, layer, 0, rng.randbytes(BLOCKS * GEOMETRY.page_bytes))
        for layer in range(GEOMETRY.num_layers)
    ]
    reply = await stub.WritePages(iter(batches), timeout=30)
    assert (reply.pages_stored, reply.pages_rejected) == (BLOCKS * GEOMETRY.num_layers, 0)
    return ref


async def test_a_member_is_served_and_nodes_pull_from_each_other(
    member: tuple[ClusterTLS, list[kv_pb2_grpc.KVStoreStub], list[str]],
) -> None:
    _, stubs, addresses = member
    ref = await _upload(stubs[0], "over-tls")
    # Node 1 pulls from node 0: its page stream (the default data plane), through TLS both ways.
    reply = await stubs[1].Pull(kv_pb2.PullRequest(session=ref, peer=addresses[0]), timeout=30)
    assert reply.complete and reply.pages_received == BLOCKS * GEOMETRY.num_layers, reply
    status = await stubs[1].GetSessionStatus(kv_pb2.SessionStatusRequest(session=ref), timeout=10)
    assert status.loadable_prefix_blocks == BLOCKS


async def test_outsiders_are_refused(
    member: tuple[ClusterTLS, list[kv_pb2_grpc.KVStoreStub], list[str]], tmp_path: Path
) -> None:
    tls, _, addresses = member
    other = ensure_tls(tmp_path / "another-cluster")
    outsiders = {
        "plaintext": grpc.aio.insecure_channel(addresses[0]),
        "no client certificate": grpc.aio.secure_channel(addresses[0], grpc.ssl_channel_credentials(tls.ca)),
        "another cluster's certificate": grpc.aio.secure_channel(
            addresses[0], grpc.ssl_channel_credentials(tls.ca, other.key, other.cert)
        ),
    }
    for name, channel in outsiders.items():
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await kv_pb2_grpc.KVStoreStub(channel).GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, name


class _FakePeer(kv_pb2_grpc.KVStoreServicer):
    """A "peer" that would hand out any session: it never gets asked, having no member certificate."""

    def __init__(self) -> None:
        self.calls = 0

    async def GetSessionStatus(self, request, context):  # type: ignore[no-untyped-def,override]
        self.calls += 1
        return kv_pb2.SessionStatus(session=request.session, num_tokens=64, num_blocks=2)


async def test_a_peer_that_is_no_member_gives_nothing(
    member: tuple[ClusterTLS, list[kv_pb2_grpc.KVStoreStub], list[str]], tmp_path: Path
) -> None:
    _, stubs, _ = member
    for name, tls in (("plaintext", None), ("another cluster", ensure_tls(tmp_path / "fake-ca"))):
        fake = _FakePeer()
        server = grpc.aio.server()
        kv_pb2_grpc.add_KVStoreServicer_to_server(fake, server)
        port = add_port(server, "127.0.0.1:0", tls)
        await server.start()
        try:
            ref = kv_pb2.SessionRef(tenant="acme", session_id=f"fake-{name}")
            reply = await stubs[1].Pull(kv_pb2.PullRequest(session=ref, peer=f"127.0.0.1:{port}"), timeout=30)
            assert not reply.complete and reply.pages_received == 0 and reply.error, (name, reply)
            assert fake.calls == 0, name  # the handshake failed before any RPC
        finally:
            await server.stop(None)


async def test_the_fault_suite_s_attempts_are_refused_and_a_member_s_accepted(
    member: tuple[ClusterTLS, list[kv_pb2_grpc.KVStoreStub], list[str]], tmp_path: Path
) -> None:
    """`symphony bench faults`' attack probes judge these listeners right: an outsider's every
    attempt is refused, and the same attempts with the cluster's own credentials count as
    accepted (the positive control: a probe that could not see acceptance would prove nothing)."""
    tls, stubs, addresses = member
    ref = await _upload(stubs[0], "attacked")
    victim = Victim(ref.tenant, ref.session_id, [])
    info = await stubs[0].GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=10)
    foreign = foreign_tls(tmp_path / "attacker")
    outsiders = {
        "plaintext": insecure_channel(addresses[0]),
        "no client certificate": no_client_cert_channel(addresses[0], tls),
        "another CA's certificate": foreign_channel(addresses[0], foreign, tls),
    }
    for how, channel in outsiders.items():
        attempts = await grpc_attempts(addresses[0], channel, how, victim)
        assert len(attempts) == 4 and not any(a.accepted for a in attempts), attempts
    insider = await grpc_attempts(addresses[0], grpc_channel(addresses[0], tls), "member", victim)
    assert all(a.accepted for a in insider), insider

    wrong_ca = foreign.client_context()
    wrong_ca.check_hostname, wrong_ca.verify_mode = False, ssl.CERT_NONE
    for how, context in (("plaintext", None), ("another CA's certificate", wrong_ca)):
        attempt = await asyncio.to_thread(
            page_stream_attempt, info.data_port, how, context, victim, info.model_fingerprint
        )
        assert not attempt.accepted and not attempt.unreachable, attempt
    own = await asyncio.to_thread(
        page_stream_attempt, info.data_port, "member", tls.client_context(), victim, info.model_fingerprint
    )
    assert own.accepted and own.detail == "a session status", own
