"""Mutual TLS between the cluster's processes: the node managers' gRPC and their page streams.

A cluster has a CA of its own (`ca.pem`, `ca.key`) and member certificates it signed (`member.pem`,
`member.key`), in `cluster.tls_dir` (default `<home>/tls`), keys owner-only. Every server asks for
a client certificate and accepts only one of the cluster's CA; every client checks the server's
against the same CA and the address it dialled (the certificate names the host's addresses). So
only members call node RPCs (`WritePages`, `Pull`, `Prefetch` with a `source_peer`, ...), and a
node pulls only from peers that are members: a fake peer has no certificate to show.

On first use the directory gets a new CA and one member certificate for this host (`ensure_tls`:
the loopback addresses, `localhost`, and the configured hosts), so a local cluster sets itself up;
`symphony certs init` does the same ahead of time and `symphony certs issue` makes a member
certificate for another host, to copy there with `ca.pem` (never `ca.key`).

Keys are ECDSA P-256; the CA lives ten years, members `MEMBER_DAYS`. Made with `cryptography`; the
handshakes are gRPC's own (BoringSSL) and Python's `ssl`.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import os
import re
import ssl
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from symphony.config import SymphonyConfig

CA_CERT, CA_KEY = "ca.pem", "ca.key"
MEMBER_CERT, MEMBER_KEY = "member.pem", "member.key"
CA_DAYS = 3650
MEMBER_DAYS = 825
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_WILDCARDS = {"", "0.0.0.0", "::"}  # listening on every address: no name a peer dials
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")  # a member's file name (`issue_member`)
_DNS = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9_*]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*"
)  # an ASCII DNS name (a leading wildcard label allowed)


class TLSSetupError(ValueError):
    """The TLS directory cannot be used: files missing, unreadable, or not a CA and its member."""


@dataclass(frozen=True)
class ClusterTLS:
    """One member's credentials: the CA's certificate, its own certificate and key (PEM)."""

    directory: Path
    ca: bytes
    cert: bytes
    key: bytes

    def server_credentials(self) -> grpc.ServerCredentials:
        """A gRPC server's: its certificate, and a client certificate of the CA required."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def server_context(self) -> ssl.SSLContext:
        """A page stream server's: TLS 1.2 or later, a client certificate of the CA required."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.directory / MEMBER_CERT, self.directory / MEMBER_KEY)
        context.load_verify_locations(cadata=self.ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        """A page stream client's: the server's certificate checked against the CA and the host."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.directory / MEMBER_CERT, self.directory / MEMBER_KEY)
        context.load_verify_locations(cadata=self.ca.decode())
        return context


HANDSHAKE_S = 5.0  # a page stream's whole TLS handshake: a client that drips bytes holds no slot longer


def server_handshake(conn: ssl.SSLSocket, timeout_s: float, within_s: float = HANDSHAKE_S) -> None:
    """Complete a server-side handshake (`conn` wrapped with do_handshake_on_connect=False) within
    `within_s` in all, then give the socket `timeout_s` per operation. Raises ssl.SSLError (not a
    member), TimeoutError (too slow) or OSError; the socket is then non-blocking, so that whatever
    the caller still writes to it (an error frame) fails at once instead of resuming the handshake."""
    deadline = time.monotonic() + within_s
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"TLS handshake not done within {within_s} s")
            conn.settimeout(remaining)
            try:
                conn.do_handshake()
                break
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                continue
    except BaseException:
        with contextlib.suppress(OSError):
            conn.settimeout(0.0)
        raise
    conn.settimeout(timeout_s)


def grpc_channel(address: str, tls: ClusterTLS | None, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to a node: mutual TLS with `tls`, plaintext without."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=list(options))


def grpc_sync_channel(address: str, tls: ClusterTLS | None) -> grpc.Channel:
    """A blocking channel to a node (benchmarks, tests)."""
    return grpc.insecure_channel(address) if tls is None else grpc.secure_channel(address, tls.channel_credentials())


def add_port(server: grpc.aio.Server, address: str, tls: ClusterTLS | None) -> int:
    """Listen on `address`, with mutual TLS under `tls`; the port, 0 when it cannot be bound."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def cluster_tls(config: SymphonyConfig) -> ClusterTLS | None:
    """The configuration's credentials (made on first use, see the module docstring); None when
    `cluster.tls` is off. TLSSetupError names what is wrong with the directory."""
    if not config.cluster.tls:
        return None
    tls = ensure_tls(tls_dir(config), config_hosts(config))
    cert = x509.load_pem_x509_certificate(tls.cert)
    if cert.not_valid_after_utc <= datetime.datetime.now(datetime.UTC):
        raise TLSSetupError(f"{tls.directory / MEMBER_CERT} expired on {cert.not_valid_after_utc:%Y-%m-%d}")
    named = {
        _canonical(str(name.value))
        for name in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    }
    missing = [host for host in dict.fromkeys(config_hosts(config)) if _canonical(host) not in named]
    if missing:
        raise TLSSetupError(
            f"{tls.directory / MEMBER_CERT} does not name {', '.join(missing)}, where this host is dialled: "
            "issue one that does (symphony certs issue NAME --hosts ...) and install it as member.pem/member.key"
        )
    return tls


def tls_dir(config: SymphonyConfig) -> Path:
    return Path(config.cluster.tls_dir).expanduser() if config.cluster.tls_dir else config.home_path / "tls"


def config_hosts(config: SymphonyConfig) -> list[str]:
    """Where this host's TLS servers are dialled: `node.host` and `node.advertise_host` (node gRPC
    and page streams; the scheduler's HTTP API is not under TLS)."""
    hosts = [h.strip("[]") for h in (config.node.host, config.node.advertise_host) if h]
    return [h for h in dict.fromkeys(hosts) if h not in _WILDCARDS]


def ensure_tls(directory: Path, hosts: Iterable[str] = ()) -> ClusterTLS:
    """The credentials in `directory`, a new CA and member certificate for `hosts` made first
    when it has none (under a lock: processes starting together make one set)."""
    with _locked(directory):
        if not (directory / CA_CERT).exists():
            init_ca(directory)
        if not (directory / MEMBER_CERT).exists():
            if not (directory / CA_KEY).exists():  # another host's: its key, if any, is the operator's
                raise TLSSetupError(
                    f"{directory} has the cluster's {CA_CERT} but no {MEMBER_CERT}: install this host's member "
                    f"certificate there (made with `symphony certs issue` where {CA_KEY} is)"
                )
            (directory / MEMBER_KEY).unlink(missing_ok=True)  # ours, whose certificate was never written
            issue_member(directory, "member", hosts, cert_name=MEMBER_CERT, key_name=MEMBER_KEY)
    return load_tls(directory)


def load_tls(directory: Path) -> ClusterTLS:
    for private in (directory / MEMBER_KEY, directory / CA_KEY):
        if private.exists() and private.stat().st_mode & 0o077:
            raise TLSSetupError(f"{private} may be read by others: chmod 600 it")
    try:
        ca, cert, key = ((directory / name).read_bytes() for name in (CA_CERT, MEMBER_CERT, MEMBER_KEY))
        authority = x509.load_pem_x509_certificate(ca)
        member = x509.load_pem_x509_certificate(cert)
        member.verify_directly_issued_by(authority)
    except (OSError, ValueError, TypeError, InvalidSignature) as exc:
        raise TLSSetupError(f"{directory}: not a cluster CA and its member certificate ({exc!r})") from None
    return ClusterTLS(directory, ca, cert, key)


def init_ca(directory: Path) -> None:
    """A new CA in `directory` (its key owner-only). Refuses to replace one."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (directory / CA_CERT).exists():
        raise TLSSetupError(f"{directory / CA_CERT} exists: a cluster has one CA")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Symphony cluster CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(directory / CA_KEY, _key_pem(key), private=True)
    _write(directory / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))


def issue_member(
    directory: Path, name: str, hosts: Iterable[str], *, cert_name: str | None = None, key_name: str | None = None
) -> tuple[Path, Path]:
    """A member certificate signed by the CA in `directory`, naming `hosts` (addresses or DNS names)
    and the loopback ones: (certificate, key) paths, `<name>.pem` and `<name>.key` by default.
    Refuses a name that is no plain file name, and files that exist (the CA's among them)."""
    if not _NAME.fullmatch(name):
        raise TLSSetupError(
            f"member name {name!r}: use 1 to 64 letters, digits, '.', '_' or '-', not starting with '.'"
        )
    cert_path, key_path = directory / (cert_name or f"{name}.pem"), directory / (key_name or f"{name}.key")
    if (
        cert_path.exists()
        or key_path.exists()
        or cert_path.name in (CA_CERT, CA_KEY)
        or key_path.name in (CA_CERT, CA_KEY)
    ):
        raise TLSSetupError(f"{cert_path} or {key_path} exists (or is the CA's): choose another name")
    try:
        ca_key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise TLSSetupError(f"{directory}: no usable CA to sign with ({exc}); run `symphony certs init`") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TLSSetupError(f"{directory / CA_KEY}: not the ECDSA key `symphony certs init` makes")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=MEMBER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(list(_names([*LOCAL_HOSTS, *hosts]))), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
        )  # digital_signature
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _canonical(host: str) -> str:
    """An address in its one spelling (fd00:0::5 is fd00::5), a name as it is."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return host.lower()


def _names(hosts: Iterable[str]) -> Iterator[x509.GeneralName]:
    seen: set[str] = set()
    for raw in hosts:
        host = raw.strip().strip("[]")  # "[fd00::5]", as node.host may write it, is an address
        if host in seen or host in _WILDCARDS:
            continue
        seen.add(host)
        try:
            yield x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            if not _DNS.fullmatch(host):
                raise TLSSetupError(f"host {raw!r} is neither an IP address nor a DNS name") from None
            yield x509.DNSName(host)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Written whole (a new temporary file renamed over), a key owner-only from its first byte."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600, O_EXCL
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        if not private:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
