"""Test certificates made at test time with the `cryptography` library: a CA and a server certificate for 127.0.0.1."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    """PEM files of one CA and one server certificate it signed."""

    ca_file: str
    """The CA certificate clients verify against."""
    cert_file: str
    """The server certificate (subjectAltName IP 127.0.0.1 and DNS localhost)."""
    key_file: str
    """The server certificate's private key (unencrypted)."""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certs(directory: Path, ca_name: str = "sluice test CA", *, client_auth: bool = False) -> CertFiles:
    """Write a fresh CA and a server certificate for 127.0.0.1 under `directory`; return their paths.

    With `client_auth` the certificate may also authenticate a client (Redis Cluster nodes present their
    own certificate when they connect to each other over TLS)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]
                                                 + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client_auth else [])),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    files = CertFiles(str(directory / "ca.pem"), str(directory / "server.pem"), str(directory / "server.key"))
    Path(files.ca_file).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    Path(files.cert_file).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    Path(files.key_file).write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                       serialization.PrivateFormat.TraditionalOpenSSL,
                                                       serialization.NoEncryption()))
    Path(files.key_file).chmod(0o600)
    return files
