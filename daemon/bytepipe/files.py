"""Digests of whole files from one read (`hash_files`), and the read `stage_files` builds on.

Reader threads `pread` chunks into a bounded pool of reused buffers (or straight into a
destination) and CRC them (the `crc32c` package releases the GIL; chunk CRCs are joined exactly
with `crc32c_combine`); the strong hash takes each file's chunks in file order from whichever
reader delivers the next one (BLAKE3 also splits each chunk over threads; `hashlib` and `blake3`
release the GIL). Chunks go round-robin over the files, biggest first, so every file's hash
advances at once. Memory stays bounded at about `2 x threads x chunk` bytes however large the
files are.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from daemon.bytepipe.engine import BufferPool, Job, OpenFiles, Sink, pread_exact, run
from daemon.bytepipe.sinks import Crcs, InOrder, Progress
from daemon.hashing import CHUNK_BYTES, DEFAULT_HASH_ALG, FileDigest

__all__ = ["crc32c_file", "crc32c_files", "hash_files", "read_files"]


def plan(files: Sequence[Path], sizes: Sequence[int], chunk: int, bases: Sequence[int] | None = None) -> list[Job]:
    """Every file cut into `chunk`-byte jobs, round-robin over the files (each in file order),
    biggest file first; `bases`: where each file starts in a flat destination."""
    per_file = []
    for i in sorted(range(len(files)), key=lambda i: -sizes[i]):
        base = bases[i] if bases is not None else 0
        per_file.append([Job(files[i], pos, min(chunk, sizes[i] - pos), base + pos) for pos in range(0, sizes[i], chunk)])
    jobs: list[Job] = []
    for k in range(max((len(q) for q in per_file), default=0)):
        jobs += [q[k] for q in per_file if k < len(q)]
    return jobs


def read_files(
    paths: Sequence[Path],
    names: Sequence[str],
    *,
    alg: str | None,
    crc: bool,
    threads: int,
    chunk: int,
    error: Callable[[str], BaseException] = OSError,
    progress: Callable[[int], None] | None = None,
    bases: Sequence[int] | None = None,
    into: Callable[[Job], memoryview] | None = None,
    extra: Sequence[Sink] = (),
    pinned: bool = False,
    on_exit: Callable[[int], None] | None = None,
) -> list[FileDigest]:
    """One read of every file, hashed (CRC32C when `crc`, `alg` when not None) and handed to
    `extra` sinks; digests in `paths` order. `names[i]` names file i in errors, made by `error`.
    A file must stay a regular file of the same size while it is read."""
    def open_error(p: Path, exc: OSError) -> BaseException:
        what = "not a regular file" if exc.strerror is None else f"cannot open ({exc.strerror})"
        return error(f"{names[paths.index(p)]}: {what}")

    # hash_files keeps the OS's own error for a file it cannot open (FileNotFoundError, ...)
    files = OpenFiles(paths, regular=True, error=None if error is OSError else open_error)
    try:
        sizes = [files.sizes[p] for p in paths]
        name_of = dict(zip(paths, names, strict=True))
        n_threads = max(1, threads)
        consumers = min(n_threads, max(1, len(paths)))
        crcs = Crcs(chunk) if crc else None
        strong = InOrder(paths, alg, threads=max(1, n_threads // consumers)) if alg is not None else None
        sinks: list[Sink] = [s for s in (crcs, strong) if s is not None]
        sinks += list(extra)
        if progress is not None:
            sinks.append(Progress(progress))

        def read(job: Job, view: memoryview) -> None:
            got = pread_exact(files.fds[job.file], view, job.offset)
            if got < job.nbytes:
                raise error(f"{name_of[job.file]}: file shrank while hashing (short read at byte {job.offset + got})")

        jobs = plan(paths, sizes, chunk, bases)
        pool = None
        if into is None:
            biggest = max(sizes, default=0)
            # pinned buffers are kept for the process: always a whole chunk, so the next read reuses them
            size = chunk if pinned else max(1, min(chunk, biggest))
            pool = BufferPool(min(2 * n_threads, max(1, len(jobs))), size, pinned=pinned)
        try:
            run(jobs, sinks, read, readers=n_threads, pool=pool, into=into, on_exit=on_exit)
        finally:
            if pool is not None:
                pool.close()
        out = []
        for p, size in zip(paths, sizes, strict=True):
            now = files.size_now(p)
            if now != size:
                raise error(f"{name_of[p]}: size changed while hashing ({size} -> {now} bytes)")
            out.append(FileDigest(size, crcs.result(p, size) if crcs is not None else "", alg,
                                  strong.hexdigest(p) if strong is not None else ""))  # fmt: skip
        return out
    finally:
        files.close()


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
    unique = list(dict.fromkeys(files))
    got = dict(zip(unique, read_files(unique, [str(p) for p in unique], alg=alg, crc=crc,
                                      threads=threads or os.cpu_count() or 1, chunk=chunk,  # fmt: skip
                                      progress=progress), strict=True))
    return [got[p] for p in files]


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
