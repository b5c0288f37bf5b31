"""Manifest signatures: HMAC-SHA256 with a shared key, Ed25519 with a key pair.

Both sign canonical JSON bytes (daemon.manifest.canonical_bytes): a manifest's, or a broadcast
session's (daemon.transport.broadcast.session_message). Key files:
HMAC: the file's bytes are the key (one trailing newline is dropped, so `openssl rand
-hex 32 > key` works). Ed25519: PEM (PKCS#8 private / SubjectPublicKeyInfo public) or
the raw 32 key bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from daemon.manifest import Manifest

ALGORITHMS = ("hmac-sha256", "ed25519")


class SignatureError(ValueError):
    """A missing, malformed or wrong signature, or an unusable key file."""


def _read_key_file(path: Path) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SignatureError(f"key file {path}: unreadable ({exc.strerror or exc})") from None
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        raise SignatureError(f"key file {path}: empty")
    return data


def read_hmac_key(path: Path) -> bytes:
    return _read_key_file(path)


def _read_ed25519_file(path: Path) -> bytes:
    """PEM text (one trailing newline dropped), or exactly 32 raw bytes: a raw key whose last
    byte happens to be 0x0a must not lose it (1 key in 256)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise SignatureError(f"key file {path}: unreadable ({exc.strerror or exc})") from None
    if len(raw) == 32 and not raw.startswith(b"-----BEGIN"):
        return raw
    return _read_key_file(path)


def read_ed25519_private(path: Path) -> Ed25519PrivateKey:
    data = _read_ed25519_file(path)
    try:
        if data.startswith(b"-----BEGIN"):
            key = serialization.load_pem_private_key(data + b"\n", password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise SignatureError(f"key file {path}: PEM key is not an Ed25519 private key")
            return key
        if len(data) == 32:
            return Ed25519PrivateKey.from_private_bytes(data)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"key file {path}: not an Ed25519 private key ({exc})") from None
    raise SignatureError(f"key file {path}: expected a PEM Ed25519 private key or 32 raw bytes")


def read_ed25519_public(path: Path) -> Ed25519PublicKey:
    data = _read_ed25519_file(path)
    try:
        if data.startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(data + b"\n")
            if not isinstance(key, Ed25519PublicKey):
                raise SignatureError(f"key file {path}: PEM key is not an Ed25519 public key")
            return key
        if len(data) == 32:
            return Ed25519PublicKey.from_public_bytes(data)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"key file {path}: not an Ed25519 public key ({exc})") from None
    raise SignatureError(f"key file {path}: expected a PEM Ed25519 public key or 32 raw bytes")


@dataclass(frozen=True, slots=True)
class HmacSigner:
    key_id: str
    key: bytes
    alg: str = "hmac-sha256"

    def sign(self, message: bytes) -> str:
        return base64.b64encode(hmac.new(self.key, message, hashlib.sha256).digest()).decode("ascii")


@dataclass(frozen=True, slots=True)
class Ed25519Signer:
    key_id: str
    key: Ed25519PrivateKey
    alg: str = "ed25519"

    def sign(self, message: bytes) -> str:
        return base64.b64encode(self.key.sign(message)).decode("ascii")


def load_signer(alg: str, key_id: str, key_file: Path) -> HmacSigner | Ed25519Signer:
    if alg == "hmac-sha256":
        return HmacSigner(key_id, read_hmac_key(key_file))
    if alg == "ed25519":
        return Ed25519Signer(key_id, read_ed25519_private(key_file))
    raise SignatureError(f"unknown signature algorithm {alg!r}; known: {list(ALGORITHMS)}")


def verify_manifest_signature(
    manifest: Manifest,
    hmac_keys: Mapping[str, Path],
    ed25519_keys: Mapping[str, Path],
) -> dict[str, Any]:
    """Raise SignatureError unless the manifest carries a valid signature by a configured key."""
    sig = manifest.signature
    if sig is None:
        raise SignatureError("manifest is unsigned but signing keys are configured")
    return verify_signature(manifest.canonical(), sig.alg, sig.key_id, sig.value, hmac_keys, ed25519_keys)


def verify_signature(
    message: bytes,
    alg: str,
    key_id: str,
    value_b64: str,
    hmac_keys: Mapping[str, Path],
    ed25519_keys: Mapping[str, Path],
    *,
    what: str = "manifest",
) -> dict[str, Any]:
    """Raise SignatureError unless `value_b64` is `alg`'s signature of `message` by configured key
    `key_id` (the manifest's and a broadcast session's signatures both come here)."""
    keys = {"hmac-sha256": hmac_keys, "ed25519": ed25519_keys}.get(alg)
    if keys is None:
        raise SignatureError(f"signature algorithm {alg!r} is not supported; known: {list(ALGORITHMS)}")
    if key_id not in keys:
        raise SignatureError(f"signature key_id {key_id!r} ({alg}) is not configured; known: {sorted(keys)}")
    try:
        value = base64.b64decode(value_b64, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError(f"signature value by {key_id!r} is not valid base64") from None
    if alg == "hmac-sha256":
        expected = hmac.new(read_hmac_key(keys[key_id]), message, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, value):
            raise SignatureError(f"bad hmac-sha256 signature by key {key_id!r}: {what} altered or wrong key")
    else:
        try:
            read_ed25519_public(keys[key_id]).verify(value, message)
        except InvalidSignature:
            raise SignatureError(f"bad ed25519 signature by key {key_id!r}: {what} altered or wrong key") from None
    return {"alg": alg, "key_id": key_id}
