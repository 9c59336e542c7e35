"""Test-only TLS material and a TLS-only ``redis-server`` (real server, no mocks).

``make_tls_files`` writes a throwaway CA, a server certificate for ``127.0.0.1``/``localhost``
and a client certificate, all signed by that CA, with the ``cryptography`` package.
``TlsLocalRedis`` is :class:`hma_redis.tools.devkit.local_redis.LocalRedis` listening on a TLS port
only (``--port 0``); its readiness check speaks TLS with the client certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hma_redis.tools.devkit.local_redis import LocalRedis


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hma_redis tests"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _leaf(
    common_name: str,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    usage: x509.ObjectIdentifier,
    san: list[x509.GeneralName] | None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def make_tls_files(
    directory: str | Path, server_names: tuple[str, ...] = ("127.0.0.1", "localhost")
) -> TlsFiles:
    """Write a CA, a server cert for ``server_names`` and a client cert into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("hma_redis test CA"))
        .issuer_name(_name("hma_redis test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key, server_cert = _leaf(
        server_names[0],
        ca_key,
        ca_cert,
        ExtendedKeyUsageOID.SERVER_AUTH,
        [_san(n) for n in server_names],
    )
    client_key, client_cert = _leaf(
        "hma-redis-client", ca_key, ca_cert, ExtendedKeyUsageOID.CLIENT_AUTH, None
    )
    files = TlsFiles(
        ca_cert=str(out / "ca.crt"),
        server_cert=str(out / "server.crt"),
        server_key=str(out / "server.key"),
        client_cert=str(out / "client.crt"),
        client_key=str(out / "client.key"),
    )
    _write_cert(ca_cert, Path(files.ca_cert))
    _write_cert(server_cert, Path(files.server_cert))
    _write_key(server_key, Path(files.server_key))
    _write_cert(client_cert, Path(files.client_cert))
    _write_key(client_key, Path(files.client_key))
    return files


class TlsLocalRedis(LocalRedis):
    """A private ``redis-server`` that accepts TLS only (plain port off, client certs required)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        super().__init__(
            extra_args=[
                "--port", "0",
                "--tls-port", "0",  # replaced below once the port is known
                "--tls-cert-file", files.server_cert,
                "--tls-key-file", files.server_key,
                "--tls-ca-cert-file", files.ca_cert,
                "--tls-auth-clients", "yes",
            ]
        )  # fmt: skip
        # LocalRedis passes "--port <port>" first; the later "--port 0" turns plain TCP off and
        # the TLS port takes the number LocalRedis picked.
        self.extra_args[3] = str(self.port)

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def tls_client(self, **kwargs: object) -> redis.Redis:
        """A raw redis-py client that trusts the test CA and presents the client cert."""
        options: dict[str, object] = {
            "host": "127.0.0.1",
            "port": self.port,
            "ssl": True,
            "ssl_ca_certs": self.files.ca_cert,
            "ssl_certfile": self.files.client_cert,
            "ssl_keyfile": self.files.client_key,
            "ssl_cert_reqs": ssl.CERT_REQUIRED,
            "socket_timeout": 2,
            "socket_connect_timeout": 2,
            **kwargs,
        }
        return redis.Redis(**options)  # type: ignore[arg-type]

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        # Names are checked by the tests; readiness only needs the server to answer.
        client = self.tls_client(
            socket_timeout=0.5, socket_connect_timeout=0.5, ssl_check_hostname=False
        )
        try:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    log = (Path(self.dir) / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server (TLS) exited at start-up:\n{log}")
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    time.sleep(0.05)
        finally:
            client.close()
        raise RuntimeError(
            f"redis-server (TLS) on port {self.port} did not answer within {timeout_s}s"
        )
