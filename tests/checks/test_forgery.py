"""A tensor changed so that every CRC32C still matches (issue 10, finding 1).

CRC32C is linear: negate `lm_head.weight`, patch 4 bytes, and the CRC, the size and a
format-1 signature all still hold. A format-2 manifest signs a strong hash per file,
so the change is caught and the file named. A format-1 manifest cannot catch it: the
checks say so, and refuse a signed format-1 manifest unless explicitly allowed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import structlog
from safetensors.numpy import load_file
from support_checks import forge_keeping_crc, write_format1_manifest

from daemon.bytepipe.files import crc32c_file
from daemon.checks import CHECK_NAMES, CheckSettings, run_checks
from daemon.checks.signatures import Ed25519Signer, HmacSigner
from daemon.cli.verify import main as verify_main
from daemon.manifest import publish
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick

NO_FORWARD = tuple(n for n in CHECK_NAMES if n != "forward")


def _key(tmp_path: Path) -> Path:
    key = tmp_path / "trainer.key"
    key.write_bytes(b"trainer-secret\n")
    return key


def test_the_forgery_negates_the_tensor_and_keeps_every_crc_and_a_valid_file(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v", seed=1)
    weights = d / "model.safetensors"
    before = load_file(str(weights))
    crc, size = crc32c_file(weights), weights.stat().st_size
    forge_keeping_crc(weights)
    assert crc32c_file(weights) == crc and weights.stat().st_size == size
    after = load_file(str(weights))  # safetensors still reads it
    changed = after["lm_head.weight"] != -before["lm_head.weight"]
    assert int(changed.sum()) <= 2  # negated, but for the (at most two) elements that fix the CRC
    assert np.isfinite(after["lm_head.weight"]).all()
    assert all(np.array_equal(after[k], before[k]) for k in before if k != "lm_head.weight")
    # the old scheme is fooled: every check passes against the CRC-only manifest written before
    genuine = make_tiny_checkpoint(tmp_path / "genuine", seed=1)
    write_format1_manifest(genuine)
    (d / "hotswap-manifest.json").write_bytes((genuine / "hotswap-manifest.json").read_bytes())
    report = run_checks(d, CheckSettings(enabled=NO_FORWARD))
    assert report.ok, report.reason


@pytest.mark.parametrize("alg", ["blake3", "sha256"])
def test_format2_hmac_signed_checkpoint_with_a_crc_preserving_forgery_is_rejected_naming_the_file(
    tmp_path: Path, alg: str
):
    key = _key(tmp_path)
    d = make_tiny_checkpoint(tmp_path / "v", seed=2, shards=2)
    publish(d, signer=HmacSigner("trainer-1", b"trainer-secret"), hash_alg=alg)
    settings = CheckSettings(enabled=NO_FORWARD, hmac_keys={"trainer-1": key}, require_manifest=True)
    assert run_checks(d, settings).ok
    shard = sorted(d.glob("*.safetensors"))[1]
    tensor = next(n for n in load_file(str(shard)))
    forge_keeping_crc(shard, tensor)
    report = run_checks(d, settings)
    assert not report.ok
    failed = report.results[-1]
    assert failed.name == "crc32c" and [r.status for r in report.results[:-1]] == ["pass", "pass"]
    assert shard.name in failed.detail["reason"] and "crc32c does" in failed.detail["reason"]
    assert failed.detail["file"] == shard.name and failed.detail["hash_alg"] == alg
    assert report.digest is None  # nothing verified, nothing recorded as the content


def test_format2_ed25519_signed_forgery_is_rejected_by_hotswap_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    priv = Ed25519PrivateKey.generate()
    pub = tmp_path / "trainer.pub"
    pub.write_bytes(priv.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))
    d = make_tiny_checkpoint(tmp_path / "v", seed=3)
    publish(d, signer=Ed25519Signer("trainer", priv))
    forge_keeping_crc(d / "model.safetensors")
    argv = [str(d), "--ed25519-key", f"trainer={pub}", "--require-manifest", "--skip", "forward", "--no-progress"]
    assert verify_main(argv) == 1
    out = capsys.readouterr().out
    assert "model.safetensors" in out and "rejected" in out


def test_signed_format1_manifest_is_refused_where_signature_keys_are_configured(tmp_path: Path):
    key = _key(tmp_path)
    d = make_tiny_checkpoint(tmp_path / "v", seed=4)
    write_format1_manifest(d, HmacSigner("trainer-1", b"trainer-secret"))
    forge_keeping_crc(d / "model.safetensors")  # its signature still verifies: it covers only CRCs
    settings = CheckSettings(enabled=NO_FORWARD, hmac_keys={"trainer-1": key})
    report = run_checks(d, settings)
    assert not report.ok and report.results[-1].name == "manifest"
    reason = report.results[-1].detail["reason"]
    assert "hotswap.manifest/1" in reason and "does not protect the weights" in reason
    assert "checks.allow_format1_manifest" in reason
    # require_manifest alone: an unsigned manifest of either format proves nothing against whoever can
    # write the directory, so format 1 is read (weak, warned about), not refused
    require_only = run_checks(d, CheckSettings(enabled=NO_FORWARD, require_manifest=True))
    assert require_only.ok and "weak" in require_only.results[0].detail


def test_allowed_format1_manifest_passes_and_says_honestly_it_cannot_catch_the_forgery(tmp_path: Path):
    key = _key(tmp_path)
    genuine = make_tiny_checkpoint(tmp_path / "genuine", seed=5)
    doc = write_format1_manifest(genuine, HmacSigner("trainer-1", b"trainer-secret"))
    forged = make_tiny_checkpoint(tmp_path / "forged", seed=5)
    forge_keeping_crc(forged / "model.safetensors")
    (forged / "hotswap-manifest.json").write_bytes((genuine / "hotswap-manifest.json").read_bytes())
    settings = CheckSettings(enabled=NO_FORWARD, hmac_keys={"trainer-1": key}, allow_format1_manifest=True)

    with structlog.testing.capture_logs() as logs:
        report = run_checks(forged, settings)
    assert report.ok, report.reason  # format 1 cannot tell: the signature and every CRC hold
    manifest, crc = report.results[0].detail, report.results[2].detail
    assert "cannot detect a deliberate (CRC-preserving) edit" in manifest["weak"]
    assert "does not protect the weights" in manifest["weak"]
    assert manifest["signature"]["covers"] == "crc32c only (format 1)"
    assert crc["compared"] == "manifest: crc32c" and "not checked" in crc["weak"]
    assert any(e["event"] == "weak_manifest" and e["log_level"] == "warning" for e in logs)
    # what it can do: the strong hashes come from the bytes, so the forgery is not the genuine content
    genuine_report = run_checks(genuine, settings)
    assert genuine_report.ok and genuine_report.digest and report.digest
    assert report.digest.startswith("blake3:") and report.digest != genuine_report.digest
    assert {f.path: f.crc32c for f in report.files} == {f["path"]: f["crc32c"] for f in doc["files"]}
    hashes = {f.path: f.hash for f in report.files}
    assert hashes["model.safetensors"] != {f.path: f.hash for f in genuine_report.files}["model.safetensors"]


def test_unsigned_format1_manifest_without_trust_settings_is_read_and_flagged_weak(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v", seed=6)
    write_format1_manifest(d)
    report = run_checks(d, CheckSettings(enabled=NO_FORWARD))
    assert report.ok, report.reason
    assert report.manifest is not None and report.manifest.weak and report.manifest.digest is None
    assert "weak" in report.results[0].detail and report.digest and report.digest.startswith("blake3:")
    assert all(f.hash_alg == "blake3" and len(f.hash) == 64 for f in report.files)
