"""Disk to flat staging buffer: header offsets, parallel positional reads, no per-tensor objects.

The safetensors headers (validated strictly by `tensor_table`) say where every tensor's bytes
are; each tensor goes to its 256-byte aligned slot in the flat buffer. Reads are split into
chunks and run through the byte pipeline (daemon.bytepipe.engine: reader threads, `os.preadv`
releases the GIL). Into shared host memory they land directly in the destination; for GPUs each
reader reads into pinned host buffers of the pipeline's pool and copies each to every staged GPU
on its own stream while it reads the next chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from daemon.bytepipe import (
    Buffer,
    BufferPool,
    DeviceCopy,
    DigestMismatch,
    Job,
    OpenFiles,
    Sink,
    pread_exact,
    run,
)
from daemon.formats import TensorLocation
from daemon.handoff import TensorSlot

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 32 << 20


class ChunkCheck(Protocol):
    """What hashes the staged chunks (daemon.bytepipe.check.LoadCheck, or the store's tee of it)."""

    def feed(self, file: Path, offset: int, data: Any) -> None: ...
    def abort(self) -> None: ...


class StagingError(RuntimeError):
    """Reading a checkpoint into the staging buffer failed; the message names the file."""


@dataclass(frozen=True, slots=True)
class ReadJob:
    file: Path
    src: int  # absolute offset in the file
    nbytes: int
    dst: int  # offset in the flat buffer


def plan_reads(
    table: dict[str, TensorLocation], slots: Sequence[TensorSlot], base: int = 0, chunk: int = CHUNK_BYTES
) -> list[ReadJob]:
    """One job per chunk of at most `chunk` bytes, in file order so reads stay sequential."""
    jobs: list[ReadJob] = []
    for s in slots:
        loc = table[s.name]
        for off in range(0, s.nbytes, chunk):
            n = min(chunk, s.nbytes - off)
            jobs.append(ReadJob(loc.file, loc.entry.start + off, n, base + s.offset + off))
    jobs.sort(key=lambda j: (str(j.file), j.src))
    return jobs


def interleave(jobs: Sequence[ReadJob]) -> list[ReadJob]:
    """Jobs round-robin over files, each file's in file order: every file's hash advances at once."""
    by_file: dict[Path, list[ReadJob]] = {}
    for j in jobs:
        by_file.setdefault(j.file, []).append(j)
    lists = [sorted(v, key=lambda j: j.src) for v in by_file.values()]
    out: list[ReadJob] = []
    for i in range(max((len(v) for v in lists), default=0)):
        out += [v[i] for v in lists if i < len(v)]
    return out


def check_ranges(jobs: Sequence[ReadJob]) -> dict[Path, list[tuple[int, int]]]:
    ranges: dict[Path, list[tuple[int, int]]] = {}
    for j in jobs:
        ranges.setdefault(j.file, []).append((j.src, j.nbytes))
    return ranges


def _files(jobs: Sequence[ReadJob]) -> OpenFiles:
    """One read-only descriptor per shard, shared by the reader threads (pread has no cursor)."""
    return OpenFiles(sorted({j.file for j in jobs}), regular=False,
                     error=lambda p, exc: StagingError(f"{p}: cannot open ({exc.strerror})"))  # fmt: skip


def _reader(files: OpenFiles) -> Callable[[Job, memoryview], None]:
    def read(job: Job, into: memoryview) -> None:
        try:
            got = pread_exact(files.fds[job.file], into, job.offset)
        except OSError as exc:
            raise StagingError(f"{job.file}: read at byte {job.offset} failed ({exc.strerror})") from None
        if got < job.nbytes:
            raise StagingError(f"{job.file}: file ends at byte {job.offset + got}, header promised more")

    return read


class _Feed:
    """The check as a sink: each chunk hashed in its reader's thread, in file order."""

    def __init__(self, check: ChunkCheck) -> None:
        self.check = check

    def take(self, job: Job, data: memoryview, buffer: Buffer | None, reader: int) -> None:
        try:
            self.check.feed(job.file, job.offset, data)
        except DigestMismatch as exc:
            raise StagingError(f"check while staging: {exc}") from None

    def abort(self) -> None:
        self.check.abort()  # nobody may wait for a failed job's bytes any more


def _jobs(jobs: Sequence[ReadJob], check: ChunkCheck | None) -> list[Job]:
    return [Job(j.file, j.src, j.nbytes, j.dst) for j in (interleave(jobs) if check is not None else jobs)]


def read_into_host(jobs: Sequence[ReadJob], dest: memoryview, threads: int = 8, check: ChunkCheck | None = None) -> None:
    """Read every job straight into `dest` (a writable view of the shared segment); with `check`,
    hash each job's bytes as they landed, in file order."""
    files = _files(jobs)
    try:
        run(_jobs(jobs, check), [_Feed(check)] if check is not None else [], _reader(files), readers=threads,
            into=lambda job: dest[job.dst : job.dst + job.nbytes])  # fmt: skip
    finally:
        files.close()


class PinnedPool:
    """How the GPU path reads: `pairs` reader threads with two pinned host buffers each (the
    buffers come from the byte pipeline's process-wide pinned memory, kept between stagings)."""

    def __init__(self, pairs: int, chunk: int = CHUNK_BYTES) -> None:
        self.chunk = chunk
        self.pairs = pairs


def read_into_devices(
    jobs: Sequence[ReadJob], dests: Sequence[torch.Tensor], pool: PinnedPool, check: ChunkCheck | None = None
) -> None:
    """Read each job into pinned memory, then copy it to the same offset of every device buffer
    (with `check`, hashing the pinned buffer while the copies run)."""
    if any(j.nbytes > pool.chunk for j in jobs):
        raise StagingError(f"read job larger than the pinned chunk ({pool.chunk} bytes)")
    files = _files(jobs)
    copy = DeviceCopy(lambda job: [(d[job.dst : job.dst + job.nbytes], 0, job.nbytes) for d in dests])
    sinks: list[Sink] = [copy] + ([_Feed(check)] if check is not None else [])
    buffers = BufferPool(2 * pool.pairs, pool.chunk, pinned=True)
    try:
        run(_jobs(jobs, check), sinks, _reader(files), readers=pool.pairs, pool=buffers, on_exit=copy.finish)
    except StagingError:
        raise
    except Exception as exc:
        raise StagingError(f"copy to GPU failed: {exc}") from exc
    finally:
        buffers.close()
        files.close()
