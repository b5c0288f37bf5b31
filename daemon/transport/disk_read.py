"""The disk transport's read machinery: checkpoint bytes from files into tensors, in parallel.

`daemon.transport.disk` owns the transport (the request, the tensor table, which path each
parameter takes, the check set-up, the read-ahead); this module owns how the bytes move, so the
threads, pinned buffers and CUDA streams live in one place, apart from the protocol. Its one
caller is `DiskTransport.write`: it cuts the staged tensors into chunks (`plan_chunks`), then
runs `read_staged` (pinned pool) and `read_direct` (CPU), which fill its `WriteStats`.

Two paths (`DiskTransport.write` picks one per parameter device):

* CUDA (fast path): the shards' data sections are cut into chunks of at most `chunk_bytes`
  (big tensors span several chunks, small ones share a chunk). Several reader threads each own
  two buffers of a pinned host pool that is allocated once per process and kept; a reader
  fills one buffer with `os.preadv` (which releases the GIL) while the copy of the other buffer
  to the GPU runs on the reader's own side stream; a CUDA event tells when a buffer is free again.
* CPU (plain path): `os.preadv` straight into the parameter's memory (a memoryview of it).

Checking (a `LoadCheck`): on the CUDA path the reader hands the buffer to its file's hashing
thread and reads on into its next buffer (3 per reader), so the hash runs beside the reads and
copies instead of holding the readers up. Errors name the file, the tensor and the offset.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.formats.checkpoint import TensorLocation
from daemon.transport.base import SourceChanged, TransportError
from daemon.transport.check import DigestMismatch, LoadCheck, is_aborted

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


class PinnedPool:
    """Page-locked host buffers, allocated once per process and reused by every update."""

    _lock = threading.Lock()
    _buffers: list[torch.Tensor] = []  # process-wide on purpose
    _buf_bytes = 0

    @classmethod
    def get(cls, count: int, buf_bytes: int) -> list[torch.Tensor]:
        import torch

        with cls._lock:
            if cls._buffers and cls._buf_bytes < buf_bytes:
                # a larger chunk size was asked for: replace the pool once
                cls._buffers = []
            if not cls._buffers:
                cls._buf_bytes = buf_bytes
            pin = torch.cuda.is_available()  # without CUDA (tests) plain host memory stands in
            while len(cls._buffers) < count:
                cls._buffers.append(torch.empty(cls._buf_bytes, dtype=torch.uint8, pin_memory=pin))
            return cls._buffers[:count]

    @classmethod
    def allocated_bytes(cls) -> int:
        with cls._lock:
            return len(cls._buffers) * cls._buf_bytes


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


def _open_all(files: set[Path]) -> dict[Path, int]:
    fds: dict[Path, int] = {}
    try:
        for f in sorted(files):
            fds[f] = os.open(f, os.O_RDONLY)
            # a larger readahead window helps the cold (disk-bound) case
            os.posix_fadvise(fds[f], 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        raise TransportError(f"{exc.filename}: cannot open ({exc.strerror})") from None
    return fds


def read_direct(
    locations: list[TensorLocation], views: dict[str, torch.Tensor], stats: WriteStats,
    check: LoadCheck | None = None, *, readers: int,
) -> None:
    """CPU parameters: read each tensor straight into its memory, a few threads in parallel."""
    fds = _open_all({loc.file for loc in locations})
    errors: list[BaseException] = []
    lock = threading.Lock()
    todo = sorted(locations, key=lambda x: (str(x.file), x.entry.start))
    cursor = iter(todo)

    def work() -> None:
        while not errors:
            with lock:
                loc = next(cursor, None)
            if loc is None:
                return
            try:
                dst = memoryview(views[loc.entry.name].numpy()).cast("B")
                _read_exact(fds[loc.file], dst, loc.entry.start, loc.file, f"tensor {loc.entry.name!r}")
                if check is not None:
                    check.feed(loc.file, loc.entry.start, dst)
            except BaseException as exc:  # noqa: BLE001 - reported by the caller
                _fail(errors, exc, check)
                return

    _run_readers([work] * min(readers, 4), fds, errors)
    stats.bytes += sum(loc.entry.nbytes for loc in locations)


def read_staged(
    chunks: list[Chunk], views: dict[str, torch.Tensor], stats: WriteStats, check: LoadCheck | None = None, *,
    readers: int, check_buffers: int, chunk_bytes: int,
) -> None:
    """CUDA parameters: readers fill pinned buffers; each copies to the GPU on its own stream.
    Checking, a reader hands the buffer to its file's hashing thread and reads on into its
    next buffer; a buffer is refilled once its copy has finished and it was hashed."""
    import contextlib

    import torch

    readers = max(1, min(readers, len(chunks)))
    per_reader = 2 if check is None else max(2, check_buffers)
    buf_bytes = max(c.nbytes for c in chunks) if chunks else 0
    buf_bytes = max(buf_bytes, min(chunk_bytes, DEFAULT_CHUNK_BYTES))
    pool = PinnedPool.get(per_reader * readers, buf_bytes)
    device = views[chunks[0].segments[0].name].device
    on_gpu = device.type == "cuda"
    fds = _open_all({c.file for c in chunks})
    errors: list[BaseException] = []
    lock = threading.Lock()
    cursor = iter(chunks)
    read_s = [0.0] * readers
    wait_s = [0.0] * readers

    def work(r: int) -> None:
        stream = _reader_stream(device, r) if on_gpu else None
        bufs = pool[per_reader * r : per_reader * (r + 1)]
        events: list[torch.cuda.Event | None] = [None] * per_reader
        hashed = [threading.Event() for _ in bufs]
        for h in hashed:
            h.set()
        arrays = [memoryview(b.numpy()) for b in bufs]
        k = 0
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while not errors:
                    t = time.perf_counter()
                    hashed[k].wait()  # before taking a chunk: a waiting reader holds none
                    ev = events[k]
                    if ev is not None:
                        ev.synchronize()  # the copy out of this buffer has finished
                    wait_s[r] += time.perf_counter() - t
                    with lock:
                        chunk = next(cursor, None)
                    if chunk is None:
                        break
                    t = time.perf_counter()
                    first = chunk.segments[0].name
                    _read_exact(
                        fds[chunk.file], arrays[k][: chunk.nbytes], chunk.offset, chunk.file, f"tensor {first!r}"
                    )
                    read_s[r] += time.perf_counter() - t
                    for s in chunk.segments:
                        dst = views[s.name][s.dst_offset : s.dst_offset + s.nbytes]
                        dst.copy_(bufs[k][s.buf_offset : s.buf_offset + s.nbytes], non_blocking=True)
                    if stream is not None:
                        e = torch.cuda.Event()
                        e.record(stream)
                        events[k] = e
                    if check is not None:  # hashed on the file's thread while the copy engine reads it
                        hashed[k].clear()
                        check.submit(chunk.file, chunk.offset, arrays[k][: chunk.nbytes], hashed[k].set)
                    k = (k + 1) % per_reader
            for h in hashed:  # the pool is shared by the next update: every buffer let go
                h.wait()
            if stream is not None:
                stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            _fail(errors, exc, check)
            for h in hashed:
                h.wait()
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.synchronize()

    _run_readers([functools.partial(work, r) for r in range(readers)], fds, errors)
    stats.bytes += sum(c.nbytes for c in chunks)
    stats.chunks += len(chunks)
    stats.readers = readers
    stats.extra["read_thread_s_max"] = max(read_s) if read_s else 0.0
    stats.extra["buffer_wait_s_max"] = max(wait_s) if wait_s else 0.0


_streams: dict[tuple[int, int], Any] = {}
_streams_lock = threading.Lock()


def _reader_stream(device: torch.device, reader: int) -> Any:
    """Reader `reader`'s side stream on `device`, made once per process (not once per update)."""
    import torch

    key = (device.index if device.index is not None else torch.cuda.current_device(), reader)
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = torch.cuda.Stream(device=device)
        return stream


def _fail(errors: list[BaseException], exc: BaseException, check: LoadCheck | None) -> None:
    """Record a reader's error; a checked load stops every reader waiting on a file's hash order."""
    if not is_aborted(exc):
        errors.append(exc)
    if check is not None:
        check.abort()


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


def _run_readers(targets: list[Callable[[], None]], fds: dict[Path, int], errors: list[BaseException]) -> None:
    """Run reader threads to completion, close the files, and raise the first error they recorded."""
    try:
        threads = [threading.Thread(target=t, daemon=True) for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for fd in fds.values():
            os.close(fd)
    if errors:
        raise _as_transport_error(errors[0])


def _as_transport_error(exc: BaseException) -> TransportError:
    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, DigestMismatch):
        return SourceChanged(f"check while loading: {exc}; nothing committed")
    return TransportError(f"{type(exc).__name__}: {exc}")
