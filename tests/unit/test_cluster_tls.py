"""symphony.cluster_tls: a cluster's CA and member certificates, and mutual TLS that admits members
only, on real gRPC servers and real TLS sockets over loopback."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import ssl
import stat
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from node_manager.kv.page_stream import PageStreamServer
from node_manager.kv.prefetch import PrefetchQueue
from node_manager.kv.puller import PeerPuller
from node_manager.kv.service import KVStoreService
from symphony.cli import main
from symphony.cluster_tls import (
    CA_KEY,
    MEMBER_CERT,
    MEMBER_KEY,
    ClusterTLS,
    TLSSetupError,
    add_port,
    cluster_tls,
    ensure_tls,
    grpc_channel,
    init_ca,
    issue_member,
    load_tls,
    server_handshake,
)
from symphony.config import SymphonyConfig, load_config
from symphony.rpc import kv_pb2, kv_pb2_grpc
from tests.helpers import wait_until
from tests.unit.kv_store_support import LAYERS, TIMEOUT, MakeStore, save_session

ECHO = "/symphony.test.Echo/Echo"


def test_a_directory_gets_a_ca_and_a_member_once(tmp_path: Path) -> None:
    directory = tmp_path / "tls"
    first = ensure_tls(directory, ["10.1.2.3", "node-a.example"])
    assert stat.S_IMODE((directory / CA_KEY).stat().st_mode) == 0o600
    assert stat.S_IMODE((directory / MEMBER_KEY).stat().st_mode) == 0o600
    again = ensure_tls(directory, ["10.9.9.9"])  # kept, not made anew
    assert again == first
    cert = x509.load_pem_x509_certificate(first.cert)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1", "10.1.2.3"}
    assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", "node-a.example"}
    with pytest.raises(TLSSetupError, match="one CA"):
        init_ca(directory)


def test_a_broken_directory_is_named(tmp_path: Path) -> None:
    ensure_tls(tmp_path / "a")
    ensure_tls(tmp_path / "b")
    (tmp_path / "a" / MEMBER_CERT).write_bytes((tmp_path / "b" / MEMBER_CERT).read_bytes())  # another CA's member
    with pytest.raises(TLSSetupError, match=str(tmp_path / "a")):
        load_tls(tmp_path / "a")
    with pytest.raises(TLSSetupError, match="no usable CA"):
        issue_member(tmp_path / "empty", "node-9", [])


@pytest.fixture
def cluster(tmp_path: Path) -> ClusterTLS:
    return ensure_tls(tmp_path / "cluster")


@pytest.fixture
async def server(cluster: ClusterTLS) -> AsyncIterator[str]:
    handler = grpc.method_handlers_generic_handler(
        "symphony.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, _: request)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = add_port(server, "127.0.0.1:0", cluster)
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def _echo(channel: grpc.aio.Channel) -> bytes:
    async with channel:
        return await channel.unary_unary(ECHO)(b"ping", timeout=5)  # type: ignore[no-any-return]


async def test_a_member_is_served(server: str, cluster: ClusterTLS) -> None:
    assert await _echo(grpc_channel(server, cluster)) == b"ping"


async def test_outsiders_are_refused(server: str, cluster: ClusterTLS, tmp_path: Path) -> None:
    """Plaintext, TLS without a client certificate, and a certificate of another cluster's CA."""
    other = ensure_tls(tmp_path / "other")
    outsiders = {
        "plaintext": grpc.aio.insecure_channel(server),
        "no client certificate": grpc.aio.secure_channel(server, grpc.ssl_channel_credentials(cluster.ca)),
        "another cluster": grpc_channel(server, other),
        "another cluster, trusting ours": grpc.aio.secure_channel(
            server, grpc.ssl_channel_credentials(cluster.ca, other.key, other.cert)
        ),
    }
    for name, channel in outsiders.items():
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _echo(channel)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, name


async def test_a_member_certificate_issued_later_is_a_member(server: str, cluster: ClusterTLS) -> None:
    """`symphony certs issue` for another host: signed by the same CA, admitted."""
    cert, key = issue_member(cluster.directory, "node-7", ["10.0.0.7"])
    joined = ClusterTLS(cluster.directory, cluster.ca, cert.read_bytes(), key.read_bytes())
    assert await _echo(grpc_channel(server, joined)) == b"ping"


def _handshake(server_context: ssl.SSLContext, client_context: ssl.SSLContext) -> tuple[str | None, str | None]:
    """A TLS handshake over a loopback TCP connection: (the server's error, the client's), None for success."""
    listener = socket.create_server(("127.0.0.1", 0))
    errors: list[str | None] = [None, None]

    def serve() -> None:
        conn, _ = listener.accept()
        conn.settimeout(5)
        try:
            with server_context.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"ok")
        except (ssl.SSLError, OSError) as exc:
            errors[0] = type(exc).__name__

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        sock = socket.create_connection(listener.getsockname(), timeout=5)
        with client_context.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
            assert tls.recv(2) == b"ok"
    except (ssl.SSLError, OSError) as exc:
        errors[1] = type(exc).__name__
    thread.join(10)
    listener.close()
    return errors[0], errors[1]


def test_page_stream_contexts_admit_members_only(cluster: ClusterTLS, tmp_path: Path) -> None:
    other = ensure_tls(tmp_path / "other")
    assert _handshake(cluster.server_context(), cluster.client_context()) == (None, None)
    # A client of another cluster: the server refuses its certificate (and it, the server's).
    assert _handshake(cluster.server_context(), other.client_context()) != (None, None)
    # A client with no certificate at all.
    bare = ssl.create_default_context(cadata=cluster.ca.decode())
    server_error, _ = _handshake(cluster.server_context(), bare)
    assert server_error is not None


class _NoGrpcPages(KVStoreService):
    """A member whose gRPC FetchPages fails: pages that arrive came over the page stream."""

    async def FetchPages(self, request, context):  # type: ignore[no-untyped-def,override]
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "pages over the page stream only")
        yield kv_pb2.PageBatch()  # pragma: no cover - abort raises


@pytest.mark.parametrize("puller_is_member", [True, False], ids=["member", "outsider"])
async def test_the_page_stream_carries_a_pull_between_members_only(
    make_store: MakeStore, tmp_path: Path, cluster: ClusterTLS, puller_is_member: bool
) -> None:
    sender = make_store(directory=tmp_path / "sender")
    save_session(sender, "s", 3, seed=11)
    stream = PageStreamServer(sender, "127.0.0.1", 0, timeout_s=TIMEOUT, tls=cluster.server_context())
    queue = PrefetchQueue(sender, sender.metrics, PeerPuller(sender, TIMEOUT), max_pending=4, concurrency=1)
    server = grpc.aio.server()
    kv_pb2_grpc.add_KVStoreServicer_to_server(_NoGrpcPages("peer", sender, queue, None, stream.port), server)  # type: ignore[arg-type]
    address = f"127.0.0.1:{add_port(server, '127.0.0.1:0', cluster)}"
    await server.start()
    receiver = make_store(directory=tmp_path / "receiver")
    credentials = cluster if puller_is_member else ensure_tls(tmp_path / "outsider")
    puller = PeerPuller(receiver, timeout_s=TIMEOUT, tls=credentials)
    try:
        if puller_is_member:
            await puller.connect(address)
            reply = await puller.pull("acme", "s", address)
            assert reply.complete and reply.pages_received == 3 * LAYERS, reply
        else:
            with pytest.raises(grpc.aio.AioRpcError):
                await puller.connect(address, timeout_s=5)
            reply = await puller.pull("acme", "s", address)
            assert not reply.complete and reply.pages_received == 0
    finally:
        await puller.close()
        await server.stop(None)
        stream.close()


def _config(tmp_path: Path, host: str = "127.0.0.1") -> SymphonyConfig:
    base = load_config(env={}, overrides={"cluster": {"tls": True}, "node": {"host": host}})
    return dataclasses.replace(base, home=str(tmp_path / "home"))


def test_a_member_certificate_must_name_where_the_host_is_dialled(tmp_path: Path) -> None:
    assert cluster_tls(_config(tmp_path)) is not None  # made on first use, for 127.0.0.1
    with pytest.raises(TLSSetupError, match=r"does not name 10\.4\.4\.4,"):
        cluster_tls(_config(tmp_path, "10.4.4.4"))  # node.host changed since: said at start, not at a handshake


def test_a_bracketed_ipv6_host_is_named_as_an_address(tmp_path: Path) -> None:
    tls = ensure_tls(tmp_path / "tls", ["[fd00::5]", "[::]"])
    names = x509.load_pem_x509_certificate(tls.cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert "fd00::5" in {str(ip) for ip in names.value.get_values_for_type(x509.IPAddress)}
    assert not any("[" in name for name in names.value.get_values_for_type(x509.DNSName))
    with pytest.raises(TLSSetupError, match="neither an IP address nor a DNS name"):
        ensure_tls(tmp_path / "bad", ["nœud.example"])


def test_a_host_with_the_ca_but_no_member_certificate_is_told_to_install_one(tmp_path: Path) -> None:
    directory = tmp_path / "tls"
    ensure_tls(directory)
    (directory / CA_KEY).unlink()  # another host: the CA's certificate copied, never its key
    (directory / MEMBER_CERT).unlink()
    with pytest.raises(TLSSetupError, match="install this host's member certificate"):
        ensure_tls(directory)
    assert (directory / MEMBER_KEY).exists()  # another host's key: the operator's, never deleted here


def test_a_readable_key_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "tls"
    ensure_tls(directory)
    (directory / MEMBER_KEY).chmod(0o644)
    with pytest.raises(TLSSetupError, match="may be read by others"):
        load_tls(directory)


def test_a_client_that_drips_its_handshake_is_dropped_in_time(cluster: ClusterTLS) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=5)
    conn, _ = listener.accept()
    stop = threading.Event()

    def drip() -> None:  # a byte every 0.2 s: each read's own timeout would never fire
        while not stop.wait(0.2):
            with contextlib.suppress(OSError):
                client.sendall(b"\x16")

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        wrapped = cluster.server_context().wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        started = time.monotonic()
        with pytest.raises((TimeoutError, ssl.SSLError)):
            server_handshake(wrapped, timeout_s=30, within_s=1.0)
        assert time.monotonic() - started < 5  # the whole handshake's bound, not a per-read one
        wrapped.close()
    finally:
        stop.set()
        dripper.join(5)
        client.close()
        listener.close()


def test_closing_a_tls_page_stream_ends_a_stream_in_its_handshake(make_store: MakeStore, cluster: ClusterTLS) -> None:
    server = PageStreamServer(make_store(), "127.0.0.1", 0, timeout_s=30, tls=cluster.server_context())
    client = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        client.sendall(b"\x16\x03\x01")  # a handshake begun, never finished
        wait_until(lambda: bool(server._streams), 5, "the stream's thread to take the connection")
        started = time.monotonic()
        server.close()
        assert time.monotonic() - started < 10  # not the stream's 30 s timeout
    finally:
        client.close()


def test_certs_issue_needs_hosts_and_regions_refuse_tls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["certs", "issue", "node-3", "--dir", str(tmp_path / "tls")])
    assert "--hosts" in capsys.readouterr().err
    config = tmp_path / "regions.toml"
    config.write_text(
        f'home = "{tmp_path}"\n[cluster]\ntls = true\n[kv]\ndata_plane = "grpc"\n'
        '[regions]\nlayout = ["a:1", "b:1"]\nlinks = ["a~b:10:100"]\n'
    )
    assert main(["node", "--config", str(config), "--index", "0"]) == 2
    assert "cluster.tls" in capsys.readouterr().err
