"""CRC32C arithmetic: joining the CRCs of consecutive pieces exactly, and the CRC-only file API.

The `crc32c` package releases the GIL while it hashes, so plain threads scale with
cores. Chunks of one file are hashed independently and joined with the standard CRC
combination (as zlib's crc32_combine, for the Castagnoli polynomial), so one big
shard uses every core too. The file reading lives in daemon.hashing (one engine for
CRC32C, the strong hash, or both from one read).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

CHUNK_BYTES = 8 * 1024 * 1024  # per read; bounded memory per thread
_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _build_x2n() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _build_x2n()


def _x8nmodp(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial."""
    p = 1 << 31  # x^0
    k = 3
    n = nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_shift(nbytes: int) -> int:
    """The operator `crc32c_combine` applies for `nbytes` of B; precompute it for a fixed chunk size."""
    return _x8nmodp(nbytes)


def crc32c_combine(crc1: int, crc2: int, len2: int, *, shift: int | None = None) -> int:
    """CRC of A+B from crc(A), crc(B) and len(B); `shift` = crc32c_shift(len2) when known."""
    return _multmodp(_x8nmodp(len2) if shift is None else shift, crc1) ^ crc2


def crc32c_files(
    paths: Sequence[str | os.PathLike[str]],
    *,
    threads: int | None = None,
    chunk: int = CHUNK_BYTES,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """CRC32C (8 lowercase hex) of each file, in order; files and chunks are hashed in parallel.

    The CRC-only mode of `daemon.hashing.hash_files` (same engine, no strong hash).
    The size is taken when hashing starts; a file that shrinks meanwhile raises OSError.
    """
    from daemon.hashing import hash_files

    return [d.crc32c for d in hash_files(paths, alg=None, threads=threads, chunk=chunk, progress=progress)]


def crc32c_file(path: str | os.PathLike[str], *, threads: int | None = 1, chunk: int = CHUNK_BYTES) -> str:
    """CRC32C of one file as 8 lowercase hex digits, streamed in `chunk`-byte reads."""
    return crc32c_files([path], threads=threads, chunk=chunk)[0]
