"""daemon.hashing: CRC32C and the strong hash from one read, equal to the reference libraries."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import blake3
import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.bytepipe.files import hash_files
from daemon.hashing import DigestMismatch, FileDigest, FileHasher, new_strong_hash

pytestmark = pytest.mark.quick

SIZES = (0, 1, 4095, 70_000, 1_000_003, 3_000_000)


def _reference(data: bytes, alg: str | None) -> str:
    if alg == "blake3":
        return blake3.blake3(data).hexdigest()
    if alg == "sha256":
        return hashlib.sha256(data).hexdigest()
    return ""


@pytest.fixture(scope="module")
def blobs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, bytes]]:
    d = tmp_path_factory.mktemp("blobs")
    out = []
    for i, n in enumerate(SIZES):
        data = os.urandom(n)
        (d / f"{i}.bin").write_bytes(data)
        out.append((d / f"{i}.bin", data))
    return out


@pytest.mark.parametrize("alg", ["blake3", "sha256", None])
@pytest.mark.parametrize("threads,chunk", [(1, 4096), (2, 65_536), (4, 4096), (8, 1 << 20)])
def test_hash_files_equals_the_libraries_for_any_threads_and_chunk(
    blobs: list[tuple[Path, bytes]], alg: str | None, threads: int, chunk: int
):
    got = hash_files([p for p, _ in blobs], alg=alg, threads=threads, chunk=chunk)
    for (_, data), d in zip(blobs, got, strict=True):
        assert d.bytes == len(data)
        assert d.crc32c == f"{crc32c.crc32c(data):08x}"
        assert d.hash_alg == alg and d.hash == _reference(data, alg)


def test_hash_only_mode_skips_the_crc(blobs: list[tuple[Path, bytes]]):
    got = hash_files([p for p, _ in blobs], alg="blake3", crc=False, threads=2)
    assert all(d.crc32c == "" and d.hash for d in got)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=5000), max_size=8))
def test_file_hasher_fed_in_any_pieces_equals_one_pass(pieces: list[bytes]):
    h = FileHasher("blake3")
    offset = 0
    for p in pieces:
        h.update_at(offset, p)
        offset += len(p)
    data = b"".join(pieces)
    assert h.result() == FileDigest(len(data), f"{crc32c.crc32c(data):08x}", "blake3", _reference(data, "blake3"))


def test_file_hasher_refuses_bytes_out_of_order():
    h = FileHasher("sha256")
    h.update_at(0, b"abc")
    with pytest.raises(ValueError, match="out of order: got offset 5, expected 3"):
        h.update_at(5, b"x")


def test_digest_check_names_the_file_and_says_whether_the_crc_was_kept():
    good = FileDigest(4, "0000abcd", "blake3", "a" * 64)
    good.check(good, "m.safetensors")
    with pytest.raises(DigestMismatch, match=r"m.safetensors: blake3 .* \(its CRC32C still matches"):
        FileDigest(4, "0000abcd", "blake3", "b" * 64).check(good, "m.safetensors")
    with pytest.raises(DigestMismatch, match="5 bytes read, 4 verified"):
        FileDigest(5, "0000abcd", "blake3", "a" * 64).check(good, "m.safetensors")
    with pytest.raises(DigestMismatch, match="hashed with sha256, verified with blake3"):
        FileDigest(4, "0000abcd", "sha256", "a" * 64).check(good, "m.safetensors")
    with pytest.raises(DigestMismatch, match="no verified digest"):
        good.check(FileDigest(4, "", None, ""), "m.safetensors")


def test_a_fifo_is_refused_without_blocking_and_no_descriptor_leaks(tmp_path: Path):
    (tmp_path / "ok.bin").write_bytes(b"x" * 100_000)
    os.mkfifo(tmp_path / "pipe")
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="not a regular file"):
        hash_files([tmp_path / "ok.bin", tmp_path / "pipe"], threads=2)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_file_that_changes_size_while_hashed_is_an_error(tmp_path: Path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(200_000))
    calls = []

    def grow(n: int) -> None:
        if not calls:
            with open(p, "ab") as f:
                f.write(b"more")
        calls.append(n)

    with pytest.raises(OSError, match="size changed while hashing"):
        hash_files([p], threads=2, chunk=4096, progress=grow)


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        new_strong_hash("md5")
