"""File hashes: CRC32C and a cryptographic hash (BLAKE3 or SHA-256) from one read of the bytes.

CRC32C catches accidents; it is linear, so anyone can change a file and patch 4 bytes
to keep it. The strong hash is what a signed manifest protects and what transports
compare with (docs/concepts/checkpoints.md "Committed: when a checkpoint is read").

Each chunk read is fed to both hashes. `hash_files` spreads the work over threads:
reader threads `pread` chunks and CRC them (the `crc32c` package releases the GIL;
chunk CRCs are joined exactly with `crc32c_combine`), and one consumer per file feeds
the chunks in file order to the strong hash (BLAKE3 also splits each chunk over
`max_threads`; `hashlib` and `blake3` release the GIL). Memory stays bounded at about
`2 x threads x chunk` bytes however large the files are.

For a transport that checks while it loads, the API is `FileHasher` (see its docstring):

    hasher = FileHasher(expected.hash_alg)          # "blake3" or "sha256"
    for offset, chunk in chunks_in_file_order:      # header bytes first, then the data
        hasher.update_at(offset, chunk)
    hasher.result().check(expected, path)           # raises DigestMismatch
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import blake3 as _blake3
import crc32c as _crc32c

from daemon.crc import crc32c_combine, crc32c_shift

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_HASH_ALG",
    "HASH_ALGORITHMS",
    "DigestMismatch",
    "FileDigest",
    "FileHasher",
    "content_digest",
    "hash_files",
    "is_hex_digest",
    "new_strong_hash",
]

# BLAKE3 by default: on this project's machines it hashes 4-5x faster than SHA-256 per core and,
# being a tree hash, splits one large file over every core; SHA-256 is sequential per file
# (bench/RESULTS.md "Verify: CRC32C and strong hashes"). SHA-256 stays for tools that expect it.
HASH_ALGORITHMS: tuple[str, ...] = ("blake3", "sha256")
DEFAULT_HASH_ALG = "blake3"
HEX_LENGTH: dict[str, int] = {"blake3": 64, "sha256": 64}
CHUNK_BYTES = 8 * 1024 * 1024  # per read; big enough for BLAKE3 to split it across threads


class StrongHash(Protocol):
    def update(self, data: Any, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_strong_hash(alg: str, *, threads: int = 1) -> StrongHash:
    """An incremental hasher for `alg`; `threads` > 1 lets BLAKE3 split each update."""
    if alg == "blake3":
        return _blake3.blake3(max_threads=max(1, threads))
    if alg == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown hash algorithm {alg!r}; known: {list(HASH_ALGORITHMS)}")


def is_hex_digest(alg: str, value: object) -> bool:
    n = HEX_LENGTH.get(alg)
    return (
        n is not None
        and isinstance(value, str)
        and len(value) == n
        and all(c in "0123456789abcdef" for c in value)
    )


class DigestMismatch(ValueError):
    """Bytes read do not match the verified digest; the message names the file and what differs."""


@dataclass(frozen=True, slots=True)
class FileDigest:
    """What one file's bytes hash to: size, CRC32C (8 hex) and the strong hash (hex) with its name."""

    bytes: int
    crc32c: str
    hash_alg: str | None  # None when only the CRC was computed
    hash: str  # "" when only the CRC was computed

    def check(self, expected: Any, path: str) -> None:
        """Raise DigestMismatch unless this equals `expected` (anything with bytes/crc32c/hash/hash_alg).

        The strong hash decides; the CRC is compared too, so a mismatch says whether the
        change kept the CRC (a deliberate edit) or not (corruption).
        """
        want_alg = getattr(expected, "hash_alg", None)
        want_hash = getattr(expected, "hash", "") or ""
        want_crc = getattr(expected, "crc32c", "") or ""
        if getattr(expected, "bytes", self.bytes) != self.bytes:
            raise DigestMismatch(f"{path}: {self.bytes} bytes read, {expected.bytes} verified")
        if want_hash:
            if want_alg != self.hash_alg:
                raise DigestMismatch(f"{path}: hashed with {self.hash_alg}, verified with {want_alg}")
            if want_hash != self.hash:
                kept = " (its CRC32C still matches: changed on purpose)" if want_crc == self.crc32c else ""
                raise DigestMismatch(
                    f"{path}: {self.hash_alg} {self.hash[:16]}... does not match the verified "
                    f"{want_hash[:16]}...{kept}"
                )
        if want_crc and want_crc != self.crc32c:
            raise DigestMismatch(f"{path}: crc32c {self.crc32c} does not match the verified {want_crc}")
        if not want_hash and not want_crc:
            raise DigestMismatch(f"{path}: no verified digest to compare with")


class FileHasher:
    """CRC32C and the strong hash of one file, fed its bytes in order: each chunk goes to both.

    Not thread-safe: one thread (e.g. a transport's consumer) feeds it, in file order.
    `update_at(offset, data)` is `update` plus a check that nothing was skipped or repeated.
    Both hashes release the GIL, so a reader thread can hash while others read.
    """

    __slots__ = ("alg", "_strong", "_crc", "_fed")

    def __init__(self, alg: str | None = DEFAULT_HASH_ALG, *, threads: int = 1) -> None:
        self.alg = alg
        self._strong = new_strong_hash(alg, threads=threads) if alg is not None else None
        self._crc = 0
        self._fed = 0

    @property
    def bytes_fed(self) -> int:
        return self._fed

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._crc = _crc32c.crc32c(view, self._crc)
        if self._strong is not None:
            self._strong.update(view)
        self._fed += len(view)

    def update_at(self, offset: int, data: Any) -> None:
        if offset != self._fed:
            raise ValueError(f"bytes fed out of order: got offset {offset}, expected {self._fed}")
        self.update(data)

    @property
    def crc32c(self) -> str:
        return f"{self._crc:08x}"

    def hexdigest(self) -> str:
        return self._strong.hexdigest() if self._strong is not None else ""

    def result(self) -> FileDigest:
        return FileDigest(self._fed, self.crc32c, self.alg, self.hexdigest())


def content_digest(files: Iterable[Any], alg: str) -> str:
    """`<alg>:<hex>`: the strong hash over `path NUL bytes NUL hash LF` of every file, in path order.

    `files` are anything with `path`, `bytes` and `hash` (hex of `alg`). Paths hold no
    NUL and hashes have a fixed length, so the encoding is unambiguous; any language
    can recompute it. This is what duplicate detection compares.
    """
    h = new_strong_hash(alg)
    for f in sorted(files, key=lambda f: f.path):
        if getattr(f, "hash_alg", alg) != alg or not is_hex_digest(alg, f.hash):
            raise ValueError(f"{f.path}: no {alg} hash to build the content digest from")
        h.update(f"{f.path}\0{f.bytes}\0{f.hash}\n".encode())
    return f"{alg}:{h.hexdigest()}"


# --------------------------------------------------------------------------- many files, many threads


@dataclass(slots=True)
class _Chunk:
    buf: bytearray
    got: int
    crc: int


def _open_regular(path: Path) -> tuple[int, int]:
    """(fd, size) of a regular file; O_NONBLOCK so a FIFO in its place cannot hang us."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_chunk(fd: int, path: Path, pos: int, want: int, buf: bytearray, crc: bool) -> _Chunk:
    view = memoryview(buf)
    got = 0
    while got < want:
        n = os.preadv(fd, [view[got:want]], pos + got)
        if n <= 0:
            raise OSError(f"{path}: file shrank while hashing (short read at byte {pos + got})")
        got += n
    return _Chunk(buf, got, _crc32c.crc32c(view[:got]) if crc else 0)


class _Stop(Exception):
    pass


def hash_files(
    paths: Sequence[str | os.PathLike[str]],
    *,
    alg: str | None = DEFAULT_HASH_ALG,
    crc: bool = True,
    threads: int | None = None,
    chunk: int = CHUNK_BYTES,
    progress: Callable[[int], None] | None = None,
) -> list[FileDigest]:
    """Size, CRC32C and `alg` hash of each file, in order, from one read of every byte.

    `alg=None` computes only the CRC, `crc=False` only the strong hash (crc32c "").
    A file must stay a regular file of the same size while it is hashed, else OSError.
    `progress(n)` is called from reader threads with each chunk's byte count.
    """
    files = [Path(p) for p in paths]
    if not files:
        return []
    n_threads = max(1, threads or os.cpu_count() or 1)
    consumers = min(n_threads, len(files))
    # read-ahead per file: enough for every reader to have a chunk in flight
    depth = max(2, -(-n_threads // consumers))
    hash_threads = max(1, n_threads // consumers)
    stop = threading.Event()
    readers = ThreadPoolExecutor(n_threads, thread_name_prefix="hash-read") if n_threads > 1 else None

    def one(path: Path) -> FileDigest:
        fd, size = _open_regular(path)
        pending: deque[Future[_Chunk] | _Chunk] = deque()
        try:
            strong = new_strong_hash(alg, threads=hash_threads) if alg is not None else None
            total_crc = 0
            full_shift = crc32c_shift(chunk)
            n_buffers = min(depth, max(1, -(-size // chunk)))
            free = [bytearray(min(chunk, max(size, 1))) for _ in range(n_buffers)]
            next_pos = 0

            def submit() -> None:
                nonlocal next_pos
                want = min(chunk, size - next_pos)
                buf = free.pop()
                if readers is None:
                    pending.append(_read_chunk(fd, path, next_pos, want, buf, crc))
                else:
                    pending.append(readers.submit(_read_chunk, fd, path, next_pos, want, buf, crc))
                next_pos += want

            while next_pos < size and free:
                submit()
            while pending:
                if stop.is_set():
                    raise _Stop
                item = pending.popleft()
                c = item.result() if isinstance(item, Future) else item
                if strong is not None:
                    strong.update(memoryview(c.buf)[: c.got])
                if crc:
                    shift = full_shift if c.got == chunk else crc32c_shift(c.got)
                    total_crc = crc32c_combine(total_crc, c.crc, c.got, shift=shift)
                if progress is not None:
                    progress(c.got)
                free.append(c.buf)
                if next_pos < size:
                    submit()
            now = os.fstat(fd).st_size
            if now != size:
                raise OSError(f"{path}: size changed while hashing ({size} -> {now} bytes)")
        finally:
            for item in pending:  # stopped early: no reader may still use the fd once it is closed
                if isinstance(item, Future) and not item.cancel():
                    with contextlib.suppress(BaseException):  # the first error is already on its way up
                        item.result()
            os.close(fd)
        return FileDigest(
            size,
            f"{total_crc:08x}" if crc else "",
            alg,
            strong.hexdigest() if strong is not None else "",
        )

    # biggest first so one large file does not start last and run alone
    order = sorted(range(len(files)), key=lambda i: -_size_or_zero(files[i]))
    out: list[FileDigest | None] = [None] * len(files)
    try:
        if consumers == 1:
            for i in order:
                out[i] = one(files[i])
        else:
            with ThreadPoolExecutor(consumers, thread_name_prefix="hash-file") as pool:
                futures = {i: pool.submit(one, files[i]) for i in order}
                try:
                    for i, fut in futures.items():
                        out[i] = fut.result()
                except BaseException:
                    stop.set()
                    for fut in futures.values():
                        fut.cancel()
                    raise
    finally:
        if readers is not None:
            readers.shutdown(wait=True, cancel_futures=True)
    return [d for d in out if d is not None]


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def crc32c_files(
    paths: Sequence[str | os.PathLike[str]],
    *,
    threads: int | None = None,
    chunk: int = CHUNK_BYTES,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """CRC32C (8 lowercase hex) of each file, in order; files and chunks are hashed in parallel.

    The CRC-only mode of `hash_files` (same engine, no strong hash).
    The size is taken when hashing starts; a file that shrinks meanwhile raises OSError.
    """
    return [d.crc32c for d in hash_files(paths, alg=None, threads=threads, chunk=chunk, progress=progress)]


def crc32c_file(path: str | os.PathLike[str], *, threads: int | None = 1, chunk: int = CHUNK_BYTES) -> str:
    """CRC32C of one file as 8 lowercase hex digits, streamed in `chunk`-byte reads."""
    return crc32c_files([path], threads=threads, chunk=chunk)[0]
