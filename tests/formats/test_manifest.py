"""The manifest: publish writes format 2 last and atomically, load is strict, hashes and digests exact."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import blake3
import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.bytepipe.files import crc32c_files
from daemon.cli.main import publish_main  # `hotswap publish` is a CLI command
from daemon.crc import crc32c_combine
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.hashing import content_digest
from daemon.manifest import (
    FORMAT,
    FORMAT_1,
    FORMAT_2,
    ManifestError,
    ManifestFile,
    canonical_bytes,
    crc32c_file,
    load_manifest,
    parse_manifest,
    publish,
)
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick

# ---------------------------------------------------------------- CRC32C engine


@pytest.mark.parametrize("size", [0, 1, 4095, 8 * 1024 * 1024 + 3, 20_000_001])
def test_crc32c_file_matches_the_library_on_whole_bytes(tmp_path: Path, size: int):
    data = os.urandom(size)
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    expected = f"{crc32c.crc32c(data):08x}"
    assert crc32c_file(p) == expected
    # split into many chunks over threads: the combined CRC is the same
    assert crc32c_files([p], threads=3, chunk=65_536) == [expected]


def test_crc32c_files_keeps_order_across_threads(tmp_path: Path):
    blobs = [os.urandom(n) for n in (5, 3_000_000, 0, 777_777)]
    paths = []
    for i, b in enumerate(blobs):
        paths.append(tmp_path / f"{i}.bin")
        paths[-1].write_bytes(b)
    assert crc32c_files(paths, threads=4, chunk=500_000) == [f"{crc32c.crc32c(b):08x}" for b in blobs]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_crc32c_combine_equals_crc_of_the_concatenation(a: bytes, b: bytes):
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_crc32c_file_reports_a_file_that_shrinks_while_hashing(tmp_path: Path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(100_000))
    seen = []

    def shrink(n: int) -> None:
        if not seen:
            os.truncate(p, 10)
        seen.append(n)

    with pytest.raises(OSError, match="shrank"):
        crc32c_files([p], chunk=4096, progress=shrink)


# ---------------------------------------------------------------- publish and load


def test_publish_lists_every_file_with_size_and_crc_and_writes_atomically(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "step-100", seed=0, shards=2)
    (d / "extra").mkdir()
    (d / "extra" / "tokenizer.json").write_text("{}")
    m = publish(d, step=100, parent="step-50")
    assert sorted(os.listdir(d)) == sorted(
        [
            "config.json",
            "extra",
            MANIFEST_NAME,
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        ]
    )  # no temporary file left behind
    assert m.version == "step-100" and m.step == 100 and m.parent == "step-50"
    on_disk = {
        p.relative_to(d).as_posix(): p.read_bytes()
        for p in d.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME
    }
    assert [f.path for f in m.files] == sorted(on_disk)
    for f in m.files:
        data = on_disk[f.path]
        assert f.bytes == len(data) and f.crc32c == f"{crc32c.crc32c(data):08x}"
        assert f.hash_alg == "blake3" and f.hash == blake3.blake3(data).hexdigest()  # as `b3sum` prints
    loaded = load_manifest(d)
    assert loaded == m and loaded.digest == m.digest and not loaded.weak
    doc = json.loads((d / MANIFEST_NAME).read_text())
    assert doc["format"] == FORMAT == FORMAT_2 and doc["created_at"].endswith("Z")
    assert doc["hash_alg"] == "blake3" and doc["digest"] == m.digest
    assert set(doc["files"][0]) == {"path", "bytes", "crc32c", "blake3"}


def test_publish_with_sha256_matches_sha256sum(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v")
    m = publish(d, hash_alg="sha256")
    for f in m.files:
        assert f.hash == hashlib.sha256((d / f.path).read_bytes()).hexdigest()
    assert m.digest is not None and m.digest.startswith("sha256:")
    assert set(json.loads((d / MANIFEST_NAME).read_text())["files"][0]) == {"path", "bytes", "crc32c", "sha256"}


def test_content_digest_is_the_strong_hash_of_path_size_hash_lines_in_path_order():
    h1, h2 = "1" * 64, "2" * 64
    files = [ManifestFile("b", 1, "00000002", h2, "blake3"), ManifestFile("a", 7, "deadbeef", h1, "blake3")]
    expected = blake3.blake3(f"a\x007\x00{h1}\nb\x001\x00{h2}\n".encode()).hexdigest()
    assert content_digest(files, "blake3") == f"blake3:{expected}"
    assert content_digest(list(reversed(files)), "blake3") == f"blake3:{expected}"
    renamed = [ManifestFile("c", 1, "00000002", h2, "blake3"), files[1]]
    assert content_digest(renamed, "blake3") != content_digest(files, "blake3")  # names are content too
    with pytest.raises(ValueError, match="no sha256 hash"):
        content_digest(files, "sha256")


def test_manifest_digest_that_does_not_match_its_files_is_rejected(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v")
    publish(d)
    doc = json.loads((d / MANIFEST_NAME).read_text())
    doc["digest"] = "blake3:" + "0" * 64
    (d / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="does not match its files' hashes"):
        load_manifest(d)


def test_format1_manifest_is_still_read_and_keeps_its_canonical_bytes(tmp_path: Path):
    """A manifest written by the previous release: readable, weak, no strong digest, same signed bytes."""
    doc = {
        "format": FORMAT_1,
        "version": "old",
        "step": 3,
        "parent": None,
        "created_at": "2026-11-01T00:00:00Z",
        "files": [{"path": "model.safetensors", "bytes": 4, "crc32c": "0000abcd"}],
    }
    m = parse_manifest(json.dumps(doc).encode())
    assert m.format == FORMAT_1 and m.weak and m.hash_alg is None and m.digest is None
    assert m.files == [ManifestFile("model.safetensors", 4, "0000abcd")]
    assert m.canonical() == canonical_bytes(doc)  # what the old publisher signed


def test_same_content_published_twice_has_the_same_digest(tmp_path: Path):
    a = publish(make_tiny_checkpoint(tmp_path / "a", seed=7), version="x")
    b = publish(make_tiny_checkpoint(tmp_path / "b", seed=7), version="y")
    c = publish(make_tiny_checkpoint(tmp_path / "c", seed=8), version="z")
    assert a.digest == b.digest != c.digest


def test_canonical_json_is_sorted_compact_utf8_without_signature():
    doc = {"version": "ü", "format": FORMAT, "files": [], "signature": {"value": "x"}}
    assert canonical_bytes(doc) == '{"files":[],"format":"hotswap.manifest/2","version":"ü"}'.encode()


def test_unknown_top_level_keys_are_kept_so_signatures_still_verify(tmp_path: Path):
    from daemon.checks.signatures import HmacSigner, verify_manifest_signature

    d = make_tiny_checkpoint(tmp_path / "v")
    m = publish(d)
    doc = json.loads((d / MANIFEST_NAME).read_text())
    doc["trainer"] = {"run": "r1"}
    signer = HmacSigner("k", b"key")
    doc["signature"] = {"alg": signer.alg, "key_id": "k", "value": signer.sign(canonical_bytes(doc))}
    (d / MANIFEST_NAME).write_text(json.dumps(doc))
    loaded = load_manifest(d)
    assert loaded.extra == {"trainer": {"run": "r1"}} and loaded.digest == m.digest
    key = tmp_path / "key"
    key.write_bytes(b"key")
    assert verify_manifest_signature(loaded, {"k": key}, {}) == {"alg": "hmac-sha256", "key_id": "k"}


def _write(d: Path, doc: object) -> None:
    (d / MANIFEST_NAME).write_text(json.dumps(doc))


GOOD_FILE = {"path": "model.safetensors", "bytes": 1, "crc32c": "0000abcd", "blake3": "ab" * 32}


def _doc(files: list, **top: object) -> dict:
    return {"format": FORMAT, "hash_alg": "blake3", "digest": "blake3:" + "0" * 64, "files": files, **top}


@pytest.mark.parametrize(
    "files,message",
    [
        ([{**GOOD_FILE, "path": "../x"}], "'..'"),
        ([{**GOOD_FILE, "path": "/abs"}], "absolute"),
        ([{**GOOD_FILE, "path": "a" * 256}], "a component is 256 bytes, over 255"),
        ([{**GOOD_FILE, "path": "/".join(["d"] * 2000)}], "2000 levels deep, over 32"),
        ([{**GOOD_FILE, "path": "/".join(["d" * 200] * 6)}], "1205 bytes, over 1024"),
        ([{**GOOD_FILE, "path": "a/./b"}], "not normalised"),
        ([{**GOOD_FILE, "path": "a/"}], "not normalised"),
        ([{**GOOD_FILE, "path": "a\\..\\b"}], "backslash"),
        ([{**GOOD_FILE, "path": ""}], "non-empty"),
        ([GOOD_FILE, GOOD_FILE], "listed twice"),
        ([{**GOOD_FILE, "crc32c": "0000ABCD"}], "8 lowercase hex"),
        ([{**GOOD_FILE, "crc32c": "abc"}], "8 lowercase hex"),
        ([{**GOOD_FILE, "bytes": -1}], "non-negative integer"),
        ([{**GOOD_FILE, "bytes": True}], "non-negative integer"),
        ([{**GOOD_FILE, "path": MANIFEST_NAME}], "may not list itself"),
        ([{"path": "x", "bytes": 1}], "exactly blake3, bytes, crc32c, path"),
        ([{k: v for k, v in GOOD_FILE.items() if k != "blake3"}], "exactly blake3, bytes, crc32c, path"),
        ([{**GOOD_FILE, "blake3": "AB" * 32}], "64 lowercase hex"),
        ([{**GOOD_FILE, "blake3": "ab" * 16}], "64 lowercase hex"),
        ([{**GOOD_FILE, "sha256": "ab" * 32}], "exactly blake3, bytes, crc32c, path"),
    ],
)
def test_load_manifest_rejects_bad_entries(tmp_path: Path, files: list, message: str):
    _write(tmp_path, _doc(files, version="v"))
    with pytest.raises(ManifestError, match=message):
        load_manifest(tmp_path)


@pytest.mark.parametrize(
    "doc,message",
    [
        ({"format": "hotswap.manifest/3", "files": []}, "format"),
        ({"format": FORMAT, "hash_alg": "blake3"}, "'files' must be a list"),
        ({"format": FORMAT, "files": []}, "hash_alg is None"),
        ({"format": FORMAT, "hash_alg": "md5", "files": []}, "hash_alg is 'md5'"),
        ({"format": FORMAT, "hash_alg": "blake3", "files": []}, "digest None does not match"),
        (_doc([], step=-3), "step"),
        (_doc([], version=5), "version must be a str"),
        (_doc([], version="a/b"), "version 'a/b' contains a slash"),
        (_doc([], version="v1\nlevel=info msg=forged"), "contains a newline"),
        (_doc([], version="v\x1b[2J"), "contains a control character"),
        (_doc([], version="v\x00"), "contains a NUL byte"),
        (_doc([], version=".."), "starts with '.'"),
        (_doc([], version="x" * 201), "201 bytes, over 200"),
        (_doc([], version=""), "must be a non-empty string"),
        (_doc([], signature={"alg": "hmac-sha256"}), "signature"),
        ([], "not a JSON object"),
    ],
)
def test_load_manifest_rejects_bad_documents(tmp_path: Path, doc: object, message: str):
    _write(tmp_path, doc)
    with pytest.raises(ManifestError, match=message):
        load_manifest(tmp_path)


def test_load_manifest_rejects_missing_oversized_and_symlink_out(tmp_path: Path):
    with pytest.raises(ManifestError, match="no manifest"):
        load_manifest(tmp_path)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "w.safetensors").write_bytes(b"x")
    (tmp_path / "link").symlink_to(outside)
    _write(tmp_path, _doc([{**GOOD_FILE, "path": "link/w.safetensors"}]))
    with pytest.raises(ManifestError, match="symlink leaving the checkpoint"):
        load_manifest(tmp_path)


def test_publish_refuses_symlinks_that_leave_the_checkpoint(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v")
    (d / "evil").symlink_to("/etc/hostname")
    with pytest.raises(ManifestError, match="evil: symlink leaving the checkpoint"):
        publish(d)
    assert not (d / MANIFEST_NAME).exists()


# ---------------------------------------------------------------- the `hotswap publish` command


def test_publish_command_signs_with_hmac_and_ed25519(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from daemon.checks import CheckSettings, run_checks

    d = make_tiny_checkpoint(tmp_path / "v")
    hkey = tmp_path / "hmac.key"
    hkey.write_text("0123456789abcdef\n")
    assert (
        publish_main(
            [str(d), "--version", "step-7", "--step", "7", "--key-file", str(hkey), "--key-id", "t1"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "published step-7" in out and "signed hmac-sha256/t1" in out
    doc = json.loads((d / MANIFEST_NAME).read_text())
    assert doc["signature"]["alg"] == "hmac-sha256" and len(base64.b64decode(doc["signature"]["value"])) == 32
    assert run_checks(d, CheckSettings(enabled=("manifest", "crc32c"), hmac_keys={"t1": hkey})).ok

    priv = Ed25519PrivateKey.generate()
    pem = tmp_path / "ed.pem"
    pem.write_bytes(
        priv.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    pub = tmp_path / "ed.pub"
    pub.write_bytes(
        priv.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    assert publish_main([str(d), "--key-file", str(pem), "--key-id", "ed", "--alg", "ed25519"]) == 0
    assert run_checks(d, CheckSettings(enabled=("manifest", "crc32c"), ed25519_keys={"ed": pub})).ok


def test_publish_command_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    d = make_tiny_checkpoint(tmp_path / "v")
    assert publish_main([str(d), "--key-id", "x"]) == 2
    assert "--key-file and --key-id go together" in capsys.readouterr().err
    assert publish_main([str(d), "--key-file", str(tmp_path / "absent"), "--key-id", "x"]) == 2
    assert "absent: unreadable" in capsys.readouterr().err
    assert publish_main([str(tmp_path / "nope")]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert not (d / MANIFEST_NAME).exists()


def test_load_manifest_refuses_a_fifo_without_blocking(tmp_path: Path):
    os.mkfifo(tmp_path / MANIFEST_NAME)
    with pytest.raises(ManifestError, match="not a regular file"):
        load_manifest(tmp_path)
