"""CRC32C arithmetic: joining the CRCs of consecutive pieces exactly.

The `crc32c` package releases the GIL while it hashes, so plain threads scale with
cores. Chunks of one file are hashed independently and joined with the standard CRC
combination (as zlib's crc32_combine, for the Castagnoli polynomial), so one big
shard uses every core too. The file reading lives in daemon.hashing (one engine for
CRC32C, the strong hash, or both from one read; `crc32c_files` is its CRC-only mode).
"""

from __future__ import annotations

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
