"""The disk transport's read machinery: checkpoint bytes from files into tensors, in parallel.

`daemon.transport.disk` owns the transport (the request, the tensor table, which path each
parameter takes, the check set-up, the read-ahead); this module owns how the bytes move, so the
threads, pinned buffers and CUDA streams live in one place, apart from the protocol. Its one
caller is `DiskTransport.write`: it cuts the staged tensors into chunks (`plan_chunks`), then
runs `read_staged` (pinned pool) and `read_direct` (CPU), which fill its `WriteStats`.

Two paths (`DiskTransport.write` picks one per parameter device):

Both run on the byte pipeline (daemon.bytepipe.engine):

* CUDA (fast path): the shards' data sections are cut into chunks of at most `chunk_bytes`
  (big tensors span several chunks, small ones share a chunk). Reader threads fill buffers of a
  pinned host pool (page-locked memory kept for the process) with `os.preadv` (which releases
  the GIL); each chunk is copied to the GPU on the reader's own side stream (`DeviceCopy`) and
  a buffer is reused once its copy's CUDA event completed.
* CPU (plain path): `os.preadv` straight into the parameter's memory (a memoryview of it).

Checking (a `LoadCheck`): on the CUDA path the buffer also goes to its file's hashing thread
and the reader reads on into its next buffer (3 per reader), so the hash runs beside the reads
and copies instead of holding the readers up. Errors name the file, the tensor and the offset.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from daemon.bytepipe import BufferPool, Checked, DeviceCopy, Job, OpenFiles, Sink, run
from daemon.formats import TensorLocation
from daemon.transport.base import SourceChanged, TransportError
from daemon.transport.check import DigestMismatch, LoadCheck

if TYPE_CHECKING:
    import torch


# From the H200 sweep (bench/RESULTS.md): page-cache reads are the bottleneck, so more readers
# help up to about the core count; 32 MiB chunks were as good as 64.
DEFAULT_CHUNK_BYTES = 32 * 1024 * 1024
DEFAULT_READERS = 16
# checking: a reader reads on while its earlier buffers wait for their file's hash
DEFAULT_CHECK_BUFFERS = 3


@dataclass(frozen=True, slots=True)
class Segment:
    """Part of one tensor that lies inside one chunk."""

    name: str
    dst_offset: int  # byte offset inside the parameter
    buf_offset: int  # byte offset inside the chunk
    nbytes: int


@dataclass(frozen=True, slots=True)
class Chunk:
    file: Path
    offset: int  # absolute file offset
    nbytes: int
    segments: tuple[Segment, ...]


@dataclass(slots=True)
class WriteStats:
    bytes: int = 0
    tensors: int = 0
    chunks: int = 0
    seconds: float = 0.0
    path: str = ""  # "staged" (pinned pool) or "direct"
    readers: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def plan_chunks(locations: Sequence[TensorLocation], chunk_bytes: int) -> list[Chunk]:
    """Cut the tensors' file ranges into chunks of at most chunk_bytes, in file order.

    Consecutive tensors of a file share a chunk while they fit, so a file is read in a few
    large sequential reads no matter how many small tensors (norms) it holds.
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    by_file: dict[Path, list[TensorLocation]] = {}
    for loc in locations:
        by_file.setdefault(loc.file, []).append(loc)
    chunks: list[Chunk] = []
    for file in sorted(by_file):
        start = end = -1
        segs: list[Segment] = []
        for loc in sorted(by_file[file], key=lambda x: x.entry.start):
            e = loc.entry
            pos = e.start
            while pos < e.end:
                if not segs or pos != end or end - start >= chunk_bytes:
                    if segs:
                        chunks.append(Chunk(file, start, end - start, tuple(segs)))
                    start = end = pos
                    segs = []
                take = min(e.end - pos, chunk_bytes - (end - start))
                segs.append(Segment(e.name, pos - e.start, pos - start, take))
                pos += take
                end = pos
        if segs:
            chunks.append(Chunk(file, start, end - start, tuple(segs)))
    return chunks


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own storage as a flat uint8 tensor (no copy; the storage must be contiguous)."""
    import torch

    flat = t.detach().reshape(-1)
    if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
        raise TransportError("parameter is not contiguous")
    return flat.view(torch.uint8)


def _read_exact(fd: int, buf: memoryview, offset: int, file: Path, what: str) -> None:
    got = 0
    n = len(buf)
    while got < n:
        r = os.preadv(fd, [buf[got:]], offset + got)
        if r <= 0:
            raise TransportError(
                f"{file}: {what}: short read at offset {offset + got}: got {got} of {n} bytes "
                "(file truncated or replaced since its header was read?)"
            )
        got += r


def _open_all(files: set[Path]) -> OpenFiles:
    # a larger readahead window helps the cold (disk-bound) case
    return OpenFiles(sorted(files), regular=False, sequential=True,
                     error=lambda p, exc: TransportError(f"{p}: cannot open ({exc.strerror})"))  # fmt: skip


def read_direct(
    locations: list[TensorLocation], views: dict[str, torch.Tensor], stats: WriteStats,
    check: LoadCheck | None = None, *, readers: int,
) -> None:
    """CPU parameters: read each tensor straight into its memory, a few threads in parallel."""
    files = _open_all({loc.file for loc in locations})
    todo = sorted(locations, key=lambda x: (str(x.file), x.entry.start))
    jobs = [Job(loc.file, loc.entry.start, loc.entry.nbytes, tag=loc) for loc in todo]

    def read(job: Job, view: memoryview) -> None:
        _read_exact(files.fds[job.file], view, job.offset, job.file, f"tensor {job.tag.entry.name!r}")

    try:
        run(jobs, [Checked(check, threaded=False)] if check is not None else [], read, readers=min(readers, 4),
            into=lambda job: memoryview(views[job.tag.entry.name].numpy()).cast("B"))  # fmt: skip
    except BaseException as exc:
        raise _as_transport_error(exc) from None
    finally:
        files.close()
    stats.bytes += sum(loc.entry.nbytes for loc in locations)


def read_staged(
    chunks: list[Chunk], views: dict[str, torch.Tensor], stats: WriteStats, check: LoadCheck | None = None, *,
    readers: int, check_buffers: int, chunk_bytes: int,
) -> None:
    """CUDA parameters: readers fill pinned buffers of the byte pipeline's pool; each chunk is
    copied to the GPU on its reader's own stream. Checking, the buffer goes to its file's hashing
    thread too and the reader reads on into its next buffer; a buffer is refilled once its copy
    has finished and it was hashed."""
    import torch

    readers = max(1, min(readers, len(chunks)))
    per_reader = 2 if check is None else max(2, check_buffers)
    buf_bytes = max(c.nbytes for c in chunks) if chunks else 0
    buf_bytes = max(buf_bytes, min(chunk_bytes, DEFAULT_CHUNK_BYTES))
    files = _open_all({c.file for c in chunks})
    read_s: dict[int, float] = {}

    def read(job: Job, view: memoryview) -> None:
        c: Chunk = job.tag
        t = time.perf_counter()
        _read_exact(files.fds[c.file], view, c.offset, c.file, f"tensor {c.segments[0].name!r}")
        me = threading.get_ident()
        read_s[me] = read_s.get(me, 0.0) + time.perf_counter() - t

    copy = DeviceCopy(lambda job: [(views[s.name][s.dst_offset : s.dst_offset + s.nbytes], s.buf_offset, s.nbytes)
                                   for s in job.tag.segments])  # fmt: skip
    sinks: list[Sink] = [copy] + ([Checked(check)] if check is not None else [])
    # without CUDA (tests) plain host memory stands in for the pinned pool
    pool = BufferPool(per_reader * readers, buf_bytes, pinned=torch.cuda.is_available())
    try:
        run([Job(c.file, c.offset, c.nbytes, tag=c) for c in chunks], sinks, read, readers=readers, pool=pool,
            on_exit=copy.finish)  # fmt: skip
    except BaseException as exc:
        raise _as_transport_error(exc) from None
    finally:
        pool.close()
        files.close()
    stats.bytes += sum(c.nbytes for c in chunks)
    stats.chunks += len(chunks)
    stats.readers = readers
    stats.extra["read_thread_s_max"] = max(read_s.values(), default=0.0)


def interleave(chunks: list[Chunk]) -> list[Chunk]:
    """Chunks round-robin over files, each file's in order, so every file's hash advances at once."""
    by_file: dict[Path, list[Chunk]] = {}
    for c in chunks:
        by_file.setdefault(c.file, []).append(c)
    queues = list(by_file.values())
    out: list[Chunk] = []
    i = 0
    while len(out) < len(chunks):
        q = queues[i % len(queues)]
        if q:
            out.append(q.pop(0))
        i += 1
    return out


def _as_transport_error(exc: BaseException) -> TransportError:
    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, DigestMismatch):
        return SourceChanged(f"check while loading: {exc}; nothing committed")
    return TransportError(f"{type(exc).__name__}: {exc}")
