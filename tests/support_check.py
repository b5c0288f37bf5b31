"""What the verify stage records for a checkpoint, computed from its bytes: the reference of check-while-load tests."""

from __future__ import annotations

from pathlib import Path

from daemon.bytepipe.files import hash_files
from daemon.transport.base import Expect, ExpectedFile


def expect_of(directory: Path, alg: str = "blake3", *, crc_only: bool = False) -> Expect:
    """Per-file digests of every file under `directory`, as the registry records them after verify."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    digests = hash_files(files, alg=None if crc_only else alg)
    out = []
    for p, d in zip(files, digests, strict=True):
        ds = {"crc32c": d.crc32c} if crc_only else {"crc32c": d.crc32c, alg: d.hash}
        out.append(ExpectedFile(p.relative_to(directory).as_posix(), d.bytes, ds))
    return Expect(files=tuple(out))


def flip_byte(file: Path, offset: int) -> None:
    """Change one byte of `file` in place (same size, same mtime granularity does not matter)."""
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))
