"""A throwaway PKI for tests: a CA, a server certificate for 127.0.0.1/localhost, a client certificate."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool, usage=None, sans=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(out: Path) -> dict[str, str]:
    """Files: ca.pem, server.pem/server.key, client.pem/client.key, other-ca.pem (a CA nobody trusts)."""
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("test-ca", ca_key, _name("test-ca"), ca_key, ca=True)
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    for name, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(name, key, ca.subject, ca_key, ca=False, usage=usage, sans=sans if name == "server" else ())
        (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, out / f"{name}.key")
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = _cert("other-ca", other_key, _name("other-ca"), other_key, ca=True)
    (out / "other-ca.pem").write_bytes(other.public_bytes(serialization.Encoding.PEM))
    return {p.stem if p.suffix == ".pem" else p.stem + "_key": str(p) for p in out.iterdir()}
