"""Manifest signatures in the verify stage: HMAC-SHA256 and Ed25519, and every way they can be wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
from support_checks import edit_manifest, published

from daemon.checks import CheckSettings, run_checks
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.manifest import publish
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick


def reject(directory: Path, settings: CheckSettings) -> tuple[str, str]:
    report = run_checks(directory, settings)
    assert not report.ok and not report.deferred
    failed = report.results[-1]
    return failed.name, failed.detail["reason"]


def _hmac_key(tmp_path: Path, name: str, value: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(value + b"\n")
    return p


def test_hmac_signed_manifest_passes_and_bad_signatures_are_rejected(tmp_path: Path):
    from daemon.checks.signatures import HmacSigner

    good_key = _hmac_key(tmp_path, "k1", b"s3cret-key-1")
    wrong_key = _hmac_key(tmp_path, "k2", b"another-key")
    d = make_tiny_checkpoint(tmp_path / "v")
    publish(d, signer=HmacSigner("trainer-1", b"s3cret-key-1"))
    settings = CheckSettings(enabled=("manifest", "crc32c"), hmac_keys={"trainer-1": good_key})
    report = run_checks(d, settings)
    assert report.ok, report.reason
    assert report.results[0].detail["signature"] == {"alg": "hmac-sha256", "key_id": "trainer-1"}

    wrong = CheckSettings(enabled=("manifest", "crc32c"), hmac_keys={"trainer-1": wrong_key})
    name, reason = reject(d, wrong)
    assert "bad hmac-sha256 signature" in reason and "trainer-1" in reason

    unknown = CheckSettings(enabled=("manifest", "crc32c"), hmac_keys={"other": good_key})
    assert "'trainer-1'" in reject(d, unknown)[1] and "not configured" in reject(d, unknown)[1]

    # altering any signed field (here the version) breaks the signature
    edit_manifest(d, lambda doc: {**doc, "version": "evil"})
    assert "bad hmac-sha256 signature" in reject(d, settings)[1]


def test_unsigned_manifest_or_no_manifest_rejected_when_keys_are_configured(tmp_path: Path):
    key = _hmac_key(tmp_path, "k", b"k")
    settings = CheckSettings(enabled=("manifest", "crc32c"), hmac_keys={"t": key})
    d = published(tmp_path / "v")
    assert "unsigned" in reject(d, settings)[1]
    (d / MANIFEST_NAME).unlink()
    assert "cannot verify a signature" in reject(d, settings)[1]


def test_ed25519_signature_verifies_and_a_forged_one_is_rejected(tmp_path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from daemon.checks.signatures import Ed25519Signer

    key = Ed25519PrivateKey.generate()
    pub = tmp_path / "trainer.pub"
    pub.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    settings = CheckSettings(enabled=("manifest", "crc32c"), ed25519_keys={"trainer": pub})
    d = make_tiny_checkpoint(tmp_path / "v")
    publish(d, signer=Ed25519Signer("trainer", key))
    assert run_checks(d, settings).ok
    publish(d, signer=Ed25519Signer("trainer", Ed25519PrivateKey.generate()))  # someone else's key
    name, reason = reject(d, settings)
    assert name == "manifest" and "bad ed25519 signature by key 'trainer'" in reason
    edit_manifest(d, lambda doc: {**doc, "signature": {**doc["signature"], "value": "%%%"}})
    assert "not valid base64" in reject(d, settings)[1]


def test_raw_ed25519_key_ending_in_a_newline_byte_is_kept_whole(tmp_path: Path) -> None:
    # a raw 32-byte key is binary: its last byte may be 0x0a and must not be stripped
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from daemon.checks.signatures import read_ed25519_private, read_ed25519_public

    seed = bytes(range(31)) + b"\n"
    priv = Ed25519PrivateKey.from_private_bytes(seed)
    (tmp_path / "k").write_bytes(seed)
    pub_raw = priv.public_key().public_bytes_raw()
    (tmp_path / "p").write_bytes(pub_raw[:31] + b"\n")  # a public key ending in 0x0a too
    loaded = read_ed25519_private(tmp_path / "k")
    assert loaded.private_bytes_raw() == seed
    assert len(read_ed25519_public(tmp_path / "p").public_bytes_raw()) == 32
