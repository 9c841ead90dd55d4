"""The mutual-TLS forwarder and the run credentials it uses (meshtrain.host.tls_forward,
meshtrain.host.credentials).

A plain echo server on loopback stands for torchft's servers. Checked: bytes cross a client
forwarder and a server forwarder unchanged both ways (1 MiB, more than one read); a party
without a certificate of the run's CA (plain TCP, TLS without a certificate, a certificate of
another CA) never reaches the echo server and gets no byte back; a client forwarder refuses a
server whose certificate is of another CA; TLS 1.2 is the oldest version accepted; and
``meshtrain keys new``'s files have the modes and extensions the contexts rely on.
"""

from __future__ import annotations

import os
import socket
import ssl
import stat
import threading
import time

import pytest

pytest.importorskip("cryptography")

from meshtrain.config import ConfigError  # noqa: E402
from meshtrain.host.credentials import (  # noqa: E402
    SiteCredentials,
    make_run_credentials,
)
from meshtrain.host.tls_forward import TlsForwarder, dial_tls, serve_tls  # noqa: E402


class EchoServer:
    """Echoes every connection's bytes back on 127.0.0.1; counts the connections it accepted."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()[:2]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:  # the forwarder dropped the connection
                pass

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two sites of one run, and a site of another run (another CA)."""
    root = tmp_path_factory.mktemp("keys")
    run = make_run_credentials(root / "run", sites=2)
    other = make_run_credentials(root / "other", sites=1)
    return {"site0": SiteCredentials.load(run[0]), "site1": SiteCredentials.load(run[1]),
            "stranger": SiteCredentials.load(other[0]), "root": root}


@pytest.fixture
def echo():
    server = EchoServer()
    yield server
    server.close()


def _round_trip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        threading.Thread(target=sock.sendall, args=(payload,), daemon=True).start()
        received = b""
        while len(received) < len(payload) and (chunk := sock.recv(65536)):
            received += chunk
    return received


def _nothing_back(sock: socket.socket) -> bool:
    """True when the peer closes (or resets) without sending a byte."""
    try:
        return sock.recv(1024) == b""
    except (ConnectionError, ssl.SSLError, OSError):
        return True


def test_bytes_cross_both_forwarders_unchanged(keys, echo):
    payload = os.urandom(1 << 20)
    with serve_tls(("127.0.0.1", 0), echo.address, keys["site0"].server_context()) as server, \
            dial_tls(server.address, keys["site1"].client_context()) as client:
        assert client.address[0] == "127.0.0.1" and server.address[0] == "127.0.0.1"
        assert _round_trip(client.address[1], payload) == payload
        assert _round_trip(client.address[1], b"again") == b"again"
    assert echo.accepted == 2
    assert server.refused == client.refused == 0


def test_plain_tcp_is_turned_away_before_the_server(keys, echo, caplog):
    with serve_tls(("127.0.0.1", 0), echo.address, keys["site0"].server_context()) as server:
        for _ in range(3):
            with socket.create_connection(server.address, timeout=20) as sock:
                sock.sendall(b"GET /status HTTP/1.1\r\nHost: lighthouse\r\n\r\n")
                assert _nothing_back(sock)
    assert echo.accepted == 0
    assert server.refused == 3
    # logged once: a client retrying in a loop does not flood stderr
    lines = [r.getMessage() for r in caplog.records if r.name == "meshtrain.tls"]
    assert len(lines) == 1 and "turned away a connection from 127.0.0.1" in lines[0], lines


def _tls_client(credentials: SiteCredentials | None, ca: SiteCredentials) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(cafile=str(ca.ca))
    if credentials is not None:
        context.load_cert_chain(str(credentials.cert), str(credentials.key))
    return context


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
def test_tls_without_a_run_certificate_is_turned_away(who, keys, echo):
    client = _tls_client(None if who == "no certificate" else keys["stranger"], keys["site0"])
    with serve_tls(("127.0.0.1", 0), echo.address, keys["site0"].server_context()) as server:
        raw = socket.create_connection(server.address, timeout=20)
        try:
            with client.wrap_socket(raw) as sock:  # TLS 1.3: the server checks after this
                sock.sendall(b"hello")
                assert _nothing_back(sock)
        except (ssl.SSLError, ConnectionError):
            pass  # refused during the handshake itself
        finally:
            raw.close()
    assert echo.accepted == 0
    assert server.refused == 1


def test_a_client_forwarder_refuses_a_server_of_another_ca(keys, echo):
    with serve_tls(("127.0.0.1", 0), echo.address, keys["stranger"].server_context()) as server, \
            dial_tls(server.address, keys["site1"].client_context()) as client:
        with socket.create_connection(client.address, timeout=20) as sock:
            sock.sendall(b"secret")
            assert _nothing_back(sock)
    assert echo.accepted == 0
    assert client.refused == 1


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion:DeprecationWarning")
def test_tls_older_than_1_2_is_refused(keys, echo):
    client = _tls_client(keys["site1"], keys["site0"])
    try:
        client.set_ciphers("DEFAULT:@SECLEVEL=0")  # let this client offer TLS 1.1 at all
        client.minimum_version = ssl.TLSVersion.TLSv1
        client.maximum_version = ssl.TLSVersion.TLSv1_1
    except (ValueError, ssl.SSLError):
        pytest.skip("this OpenSSL cannot offer TLS 1.1")
    with serve_tls(("127.0.0.1", 0), echo.address, keys["site0"].server_context()) as server:
        with socket.create_connection(server.address, timeout=20) as raw:
            with pytest.raises((ssl.SSLError, ConnectionError)):
                client.wrap_socket(raw).sendall(b"x")
        deadline = time.monotonic() + 10
        while not server.refused and time.monotonic() < deadline:
            time.sleep(0.05)
    if not server.refused:
        pytest.skip("this OpenSSL's client did not send a TLS 1.1 hello")
    assert echo.accepted == 0


def test_contexts_require_certificates_and_tls_1_2(keys):
    for context in (keys["site0"].server_context(), keys["site0"].client_context()):
        assert context.verify_mode == ssl.CERT_REQUIRED
        assert context.minimum_version == ssl.TLSVersion.TLSv1_2
        # trust is the run CA alone, not the system's CAs
        assert [c["subject"] for c in context.get_ca_certs()] == [
            c["subject"] for c in keys["site1"].client_context().get_ca_certs()]
        assert len(context.get_ca_certs()) == 1


def test_a_busy_address_raises_from_start(echo):
    with TlsForwarder(("127.0.0.1", 0), echo.address) as first:
        with pytest.raises(OSError):
            TlsForwarder(first.address, echo.address).start()


def test_close_drops_the_forwarders_connections(keys, echo):
    forwarder = TlsForwarder(("127.0.0.1", 0), echo.address).start()
    sock = socket.create_connection(forwarder.address, timeout=20)
    sock.sendall(b"ping")
    assert sock.recv(4) == b"ping"
    forwarder.close()
    assert _nothing_back(sock)
    sock.close()
    with pytest.raises(OSError):
        socket.create_connection(forwarder.address, timeout=5)


# ---------------------------------------------------------------- credentials


def test_keys_have_private_modes_and_each_site_only_its_own_files(keys):
    run = keys["root"] / "run"
    mode = {p.relative_to(run).as_posix(): stat.S_IMODE(p.stat().st_mode)
            for p in [run, *run.rglob("*")]}
    assert mode == {".": 0o700, "ca": 0o700, "ca/ca-key.pem": 0o600, "ca/ca.pem": 0o644,
                    "site-0": 0o700, "site-0/ca.pem": 0o644, "site-0/cert.pem": 0o644,
                    "site-0/key.pem": 0o600, "site-1": 0o700, "site-1/ca.pem": 0o644,
                    "site-1/cert.pem": 0o644, "site-1/key.pem": 0o600}
    assert (run / "site-0" / "ca.pem").read_bytes() == (run / "ca" / "ca.pem").read_bytes()
    assert (run / "site-0" / "key.pem").read_bytes() != (run / "site-1" / "key.pem").read_bytes()
    assert b"PRIVATE KEY" in (run / "site-1" / "key.pem").read_bytes()


def test_site_certificates_are_signed_by_the_run_ca_for_both_roles(keys):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    run = keys["root"] / "run"
    ca = x509.load_pem_x509_certificate((run / "ca" / "ca.pem").read_bytes())
    site = x509.load_pem_x509_certificate((run / "site-1" / "cert.pem").read_bytes())
    site.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not site.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = site.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


def test_keys_new_refuses_an_existing_directory(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        make_run_credentials(tmp_path / "taken", sites=1)
    assert list((tmp_path / "taken").iterdir()) == []
    with pytest.raises(ConfigError, match="--sites 0"):
        make_run_credentials(tmp_path / "none", sites=0)
    assert not (tmp_path / "none").exists()


def test_loading_names_what_is_wrong(keys, tmp_path):
    run = keys["root"] / "run"
    with pytest.raises(ConfigError, match="not a directory"):
        SiteCredentials.load(tmp_path / "missing")
    with pytest.raises(ConfigError, match="run CA's directory"):
        SiteCredentials.load(run / "ca")
    site = tmp_path / "site"
    site.mkdir()
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (site / name).write_bytes((run / "site-0" / name).read_bytes())
    os.chmod(site / "key.pem", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        SiteCredentials.load(site)
    os.chmod(site / "key.pem", 0o600)
    (site / "cert.pem").write_bytes((run / "site-1" / "cert.pem").read_bytes())  # not its key
    with pytest.raises(ConfigError, match="a pair"):
        SiteCredentials.load(site).server_context()
