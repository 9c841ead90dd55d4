"""A run's TLS credentials: its own certificate authority and one certificate per site.

``meshtrain keys new DIR --sites N`` (:func:`make_run_credentials`) writes::

    DIR/ca/ca-key.pem     the run CA's private key (0600): keep it off the training machines
    DIR/ca/ca.pem         the run CA's certificate
    DIR/site-K/ca.pem     the run CA's certificate (what a site trusts)
    DIR/site-K/cert.pem   site K's certificate, signed by the run CA (client and server use)
    DIR/site-K/key.pem    site K's private key (0600)

Each site receives only its own ``site-K`` directory (``parallel.tls_dir``, ``meshtrain
lighthouse --tls-dir``). Every directory is 0700. :class:`SiteCredentials` loads one and makes
the TLS contexts of :mod:`meshtrain.host.tls_forward`: TLS 1.2 or newer, a certificate required
on both sides and verified against the run CA alone (not the system's CAs). Names are not
checked: the run CA signs for this run only, so holding a certificate it signed is what makes a
party one of the run's.

Keys are ECDSA P-256, certificates SHA-256; the private keys are stored unencrypted (the
training processes load them unattended), so their file modes are what protects them.
Generating them needs the ``cryptography`` package (the ``tls`` extra); using them needs only
Python's ``ssl``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import ssl
import stat
from pathlib import Path

from meshtrain.config import ConfigError

CA_DIR = "ca"
CA_KEY = "ca-key.pem"
CA_CERT = "ca.pem"
SITE_FILES = ("ca.pem", "cert.pem", "key.pem")
"""The files of a site directory: the run CA's certificate, the site's certificate and key."""


def site_dir_name(index: int) -> str:
    """The directory of site ``index`` inside a credentials directory."""
    return f"site-{index}"


@dataclasses.dataclass(frozen=True)
class SiteCredentials:
    """One site's directory: the run CA's certificate, its own certificate and key."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def cert(self) -> Path:
        return self.directory / "cert.pem"

    @property
    def key(self) -> Path:
        return self.directory / "key.pem"

    @classmethod
    def load(cls, directory: str | os.PathLike, what: str = "the TLS directory"
             ) -> SiteCredentials:
        """Check that ``directory`` holds a site's files, its key readable by its owner only;
        raises ConfigError naming what is wrong (``what``: how the message names the setting)."""
        path = Path(directory).expanduser()
        if not path.is_dir():
            raise ConfigError(f"{what} {str(path)!r} is not a directory; make one with "
                              "`meshtrain keys new DIR --sites N` and give each site its "
                              "DIR/site-K.")
        missing = [name for name in SITE_FILES if not (path / name).is_file()]
        if missing:
            hint = (" (that is the run CA's directory: give a site's DIR/site-K)"
                    if (path / CA_KEY).exists() else "")
            raise ConfigError(f"{what} {str(path)!r} lacks {', '.join(missing)}{hint}; a site "
                              f"directory made by `meshtrain keys new` holds "
                              f"{', '.join(SITE_FILES)}.")
        mode = stat.S_IMODE((path / "key.pem").stat().st_mode)
        if mode & 0o077:
            raise ConfigError(f"{path / 'key.pem'} can be read by other users (mode "
                              f"{mode:04o}): `chmod 600` it (the site's private key).")
        return cls(path)

    def _context(self, purpose: int) -> ssl.SSLContext:
        context = ssl.SSLContext(purpose)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if purpose == ssl.PROTOCOL_TLS_CLIENT:
            # Sites are named by the run CA, not by DNS: any certificate it signed is a party
            # of the run, wherever it connects from or to.
            context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_verify_locations(cafile=str(self.ca))
            context.load_cert_chain(str(self.cert), str(self.key))
        except (ssl.SSLError, OSError) as error:
            raise ConfigError(f"cannot load the TLS credentials in {self.directory}: {error} "
                              "(are cert.pem and key.pem a pair made by `meshtrain keys "
                              "new`?)") from None
        return context

    def server_context(self) -> ssl.SSLContext:
        """TLS 1.2+ server side: presents this site's certificate and requires the client's,
        verified against the run CA."""
        return self._context(ssl.PROTOCOL_TLS_SERVER)

    def client_context(self) -> ssl.SSLContext:
        """TLS 1.2+ client side: presents this site's certificate and requires the server's,
        verified against the run CA."""
        return self._context(ssl.PROTOCOL_TLS_CLIENT)


def make_run_credentials(directory: str | os.PathLike, sites: int, days: int = 365,
                         ) -> list[Path]:
    """Write a new run CA and ``sites`` site certificates under ``directory`` (module
    docstring), which must not exist yet; returns the site directories. Raises ConfigError for
    an existing directory, a bad count, or a missing ``cryptography`` package."""
    if sites < 1:
        raise ConfigError(f"--sites {sites} must be at least 1 (one directory per site that "
                          "runs a replica group or the lighthouse).")
    if days < 1:
        raise ConfigError(f"--days {days} must be at least 1.")
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ConfigError("meshtrain keys needs the cryptography package, which is not "
                          "installed: pip install 'meshtrain[tls]' (or pip install "
                          "cryptography).") from None
    root = Path(directory).expanduser()
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        raise ConfigError(f"{root} already exists; meshtrain keys new never overwrites "
                          "credentials: choose a new directory (or remove the old one "
                          "yourself).") from None
    os.chmod(root, 0o700)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    tag = os.urandom(4).hex()

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshtrain"),
                          x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name(f"meshtrain run CA {tag}")
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(
                   digital_signature=False, content_commitment=False, key_encipherment=False,
                   data_encipherment=False, key_agreement=False, key_cert_sign=True,
                   crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                              critical=False)
               .sign(ca_key, hashes.SHA256()))
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    ca_dir = _private_dir(root / CA_DIR)
    _write(ca_dir / CA_KEY, pem(ca_key), 0o600)
    _write(ca_dir / CA_CERT, ca_pem, 0o644)
    made = []
    for index in range(sites):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(f"meshtrain site {index} {tag}"))
                .issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=False,
                    crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .add_extension(x509.SubjectAlternativeName(
                    [x509.DNSName(f"meshtrain-site-{index}")]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        site = _private_dir(root / site_dir_name(index))
        _write(site / "ca.pem", ca_pem, 0o644)
        _write(site / "cert.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
        _write(site / "key.pem", pem(key), 0o600)
        made.append(site)
    return made


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    return path


def _write(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` (never an existing file) with ``mode`` from the start, so a private key
    is never readable by others, not even for a moment."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as file:
        os.fchmod(fd, mode)  # exactly ``mode`` (the umask may have cleared bits of it)
        file.write(data)
