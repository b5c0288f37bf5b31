"""A throwaway CA, a server certificate for 127.0.0.1 and client certificates (cryptography)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
    c, k = directory / f"{stem}.crt", directory / f"{stem}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))  # fmt: skip
    k.chmod(0o600)
    return str(c), str(k)


def _cert(subject: str, issuer: x509.Name, issuer_key: ec.EllipticCurvePrivateKey, key: ec.EllipticCurvePrivateKey,
          *, ca: bool = False, server: bool = False) -> x509.Certificate:  # fmt: skip
    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
         .not_valid_after(now + dt.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))  # fmt: skip
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False),
                            critical=True)  # fmt: skip
    elif server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                         x509.DNSName("localhost")]), critical=False)  # fmt: skip
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


class Pki:
    """ca.crt, server.crt/key (127.0.0.1), client.crt/key signed by the CA, and rogue.crt/key by another CA."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _cert("hotswap test CA", _name("hotswap test CA"), ca_key, ca_key, ca=True)
        self.ca, _ = _write(directory, "ca", ca, ca_key)
        server_key = ec.generate_private_key(ec.SECP256R1())
        self.server = _write(directory, "server", _cert("127.0.0.1", ca.subject, ca_key, server_key, server=True),
                             server_key)  # fmt: skip
        client_key = ec.generate_private_key(ec.SECP256R1())
        self.client = _write(directory, "client", _cert("trainer-1", ca.subject, ca_key, client_key), client_key)
        other_key = ec.generate_private_key(ec.SECP256R1())
        rogue_key = ec.generate_private_key(ec.SECP256R1())
        self.rogue = _write(directory, "rogue", _cert("trainer-1", _name("other CA"), other_key, rogue_key),
                            rogue_key)  # fmt: skip
