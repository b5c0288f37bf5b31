"""Today's `hash_files` as it was before the byte pipeline (tree d23160d), kept only as the
reference `bench/verify.py` measures the pipeline against in the same run. Not used by the daemon.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import crc32c as _crc32c

from daemon.crc import crc32c_combine, crc32c_shift
from daemon.hashing import CHUNK_BYTES, DEFAULT_HASH_ALG, FileDigest, new_strong_hash


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
