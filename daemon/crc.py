"""CRC32C of files: streamed in bounded chunks, spread over threads, segments combined exactly.

The `crc32c` package releases the GIL while it hashes, so plain threads scale with
cores. Large files are cut into segments hashed independently and joined with the
standard CRC combination (as zlib's crc32_combine, for the Castagnoli polynomial),
so one big shard uses every core too. Memory stays at `threads x chunk` bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import crc32c as _crc32c

CHUNK_BYTES = 8 * 1024 * 1024  # per read; bounded memory per thread
SEGMENT_BYTES = 256 * 1024 * 1024  # a file larger than this is split across threads
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


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC of A+B from crc(A), crc(B) and len(B)."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


@dataclass(frozen=True, slots=True)
class _Segment:
    file_index: int
    path: Path
    offset: int
    length: int


def _crc_segment(seg: _Segment, chunk: int, progress: Callable[[int], None] | None) -> int:
    buf = bytearray(min(chunk, max(seg.length, 1)))
    view = memoryview(buf)
    crc = 0
    remaining = seg.length
    fd = os.open(seg.path, os.O_RDONLY)
    try:
        pos = seg.offset
        while remaining > 0:
            want = min(remaining, len(buf))
            got = os.preadv(fd, [view[:want]], pos)
            if got <= 0:
                raise OSError(f"{seg.path}: file shrank while hashing (short read at byte {pos})")
            crc = _crc32c.crc32c(view[:got], crc)
            pos += got
            remaining -= got
            if progress is not None:
                progress(got)
    finally:
        os.close(fd)
    return crc


def crc32c_files(
    paths: Sequence[str | os.PathLike[str]],
    *,
    threads: int | None = None,
    chunk: int = CHUNK_BYTES,
    segment: int = SEGMENT_BYTES,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """CRC32C (8 lowercase hex) of each file, in order; files are hashed in parallel.

    The size is taken when hashing starts; a file that shrinks meanwhile raises OSError.
    `progress(n)` is called from worker threads with the byte count of each chunk.
    """
    files = [Path(p) for p in paths]
    sizes = [os.stat(p).st_size for p in files]
    segments: list[_Segment] = []
    for i, (p, size) in enumerate(zip(files, sizes, strict=True)):
        off = 0
        while True:
            length = min(segment, size - off)
            segments.append(_Segment(i, p, off, length))
            off += length
            if off >= size:
                break
    n_threads = max(1, min(threads or os.cpu_count() or 1, len(segments)))
    if n_threads == 1:
        seg_crcs = [_crc_segment(s, chunk, progress) for s in segments]
    else:
        # biggest first so one large tail segment does not run alone at the end
        order = sorted(range(len(segments)), key=lambda k: -segments[k].length)
        seg_crcs = [0] * len(segments)
        with ThreadPoolExecutor(n_threads, thread_name_prefix="crc32c") as pool:
            futures = {k: pool.submit(_crc_segment, segments[k], chunk, progress) for k in order}
            for k, fut in futures.items():
                seg_crcs[k] = fut.result()
    combined = [0] * len(files)
    started = [False] * len(files)
    for seg, crc in zip(segments, seg_crcs, strict=True):
        i = seg.file_index
        combined[i] = crc32c_combine(combined[i], crc, seg.length) if started[i] else crc
        started[i] = True
    return [f"{c:08x}" for c in combined]


def crc32c_file(path: str | os.PathLike[str], *, threads: int | None = 1, chunk: int = CHUNK_BYTES) -> str:
    """CRC32C of one file as 8 lowercase hex digits, streamed in `chunk`-byte reads."""
    return crc32c_files([path], threads=threads, chunk=chunk)[0]
