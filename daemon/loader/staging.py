"""Disk to flat staging buffer: header offsets, parallel positional reads, no per-tensor objects.

The safetensors headers (validated strictly by `tensor_table`) say where every tensor's bytes
are; each tensor goes to its 256-byte aligned slot in the flat buffer. Reads are split into
chunks and spread over threads (`os.preadv` releases the GIL). Into shared host memory they
land directly in the destination; for GPUs each thread reads into one of two pinned host
buffers and copies it to every staged GPU on its own stream while it reads the next chunk.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from daemon.bytepipe.check import DigestMismatch, is_aborted
from daemon.formats.checkpoint import TensorLocation
from daemon.handoff.descriptor import TensorSlot

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 32 << 20


class ChunkCheck(Protocol):
    """What hashes the staged chunks (daemon.transport.check.LoadCheck, or the store's tee of it)."""

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


class _Files:
    """One read-only descriptor per shard, shared by the reader threads (pread has no cursor)."""

    def __init__(self, jobs: Sequence[ReadJob]) -> None:
        self.fds: dict[Path, int] = {}
        try:
            for f in {j.file for j in jobs}:
                self.fds[f] = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self.close()
            raise StagingError(f"{exc.filename}: cannot open ({exc.strerror})") from None

    def read(self, job: ReadJob, into: memoryview) -> None:
        fd, done = self.fds[job.file], 0
        while done < job.nbytes:
            try:
                n = os.preadv(fd, [into[done : job.nbytes]], job.src + done)
            except OSError as exc:
                raise StagingError(f"{job.file}: read at byte {job.src + done} failed ({exc.strerror})") from None
            if n == 0:
                raise StagingError(f"{job.file}: file ends at byte {job.src + done}, header promised more")
            done += n

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


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


def _checked(check: ChunkCheck | None, job: ReadJob, data: memoryview) -> None:
    if check is None:
        return
    try:
        check.feed(job.file, job.src, data)
    except DigestMismatch as exc:
        raise StagingError(f"check while staging: {exc}") from None


def read_into_host(jobs: Sequence[ReadJob], dest: memoryview, threads: int = 8, check: ChunkCheck | None = None) -> None:
    """Read every job straight into `dest` (a writable view of the shared segment); with `check`,
    hash each job's bytes as they landed, in file order."""
    files = _Files(jobs)
    order = interleave(jobs) if check is not None else list(jobs)

    def one(j: ReadJob) -> None:
        try:
            view = dest[j.dst : j.dst + j.nbytes]
            files.read(j, view)
            _checked(check, j, view)
        except BaseException:
            if check is not None:
                check.abort()  # nobody may wait for this job's bytes any more
            raise

    try:
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="stage-read") as pool:
            futures = [pool.submit(one, j) for j in order]
            first: BaseException | None = None
            for f in futures:
                try:
                    f.result()
                except BaseException as exc:  # noqa: BLE001 - the first real one is raised below
                    if first is None and not is_aborted(exc):
                        first = exc
            if first is not None:
                raise first
    finally:
        files.close()


class PinnedPool:
    """Pairs of pinned host buffers for the GPU path, kept between stagings (pinning is slow)."""

    def __init__(self, pairs: int, chunk: int = CHUNK_BYTES) -> None:
        import torch

        self.chunk = chunk
        self._free: queue.SimpleQueue[list[torch.Tensor]] = queue.SimpleQueue()
        for _ in range(pairs):
            self._free.put([torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)])
        self.pairs = pairs

    def take(self) -> list[torch.Tensor]:
        return self._free.get()

    def give(self, pair: list[torch.Tensor]) -> None:
        self._free.put(pair)


def read_into_devices(
    jobs: Sequence[ReadJob], dests: Sequence[torch.Tensor], pool: PinnedPool, check: ChunkCheck | None = None
) -> None:
    """Read each job into pinned memory, then copy it to the same offset of every device buffer
    (with `check`, hashing the pinned buffer while the copies run)."""
    import torch

    if any(j.nbytes > pool.chunk for j in jobs):
        raise StagingError(f"read job larger than the pinned chunk ({pool.chunk} bytes)")
    files = _Files(jobs)
    todo: queue.SimpleQueue[ReadJob | None] = queue.SimpleQueue()
    for j in interleave(jobs) if check is not None else jobs:
        todo.put(j)
    for _ in range(pool.pairs):
        todo.put(None)
    errors: list[BaseException] = []

    def run() -> None:
        pair = pool.take()
        streams = [torch.cuda.Stream(device=d.device) for d in dests]
        events: list[list[torch.cuda.Event | None]] = [[None] * len(dests) for _ in pair]
        slot = 0
        try:
            while not errors:
                job = todo.get()
                if job is None:
                    break
                for ev in events[slot]:
                    if ev is not None:
                        ev.synchronize()  # the copy out of this pinned buffer has finished
                host = pair[slot]
                files.read(job, memoryview(host.numpy())[: job.nbytes])
                for k, (d, s) in enumerate(zip(dests, streams, strict=True)):
                    with torch.cuda.stream(s):
                        d[job.dst : job.dst + job.nbytes].copy_(host[: job.nbytes], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(s)
                        events[slot][k] = ev
                _checked(check, job, memoryview(host.numpy())[: job.nbytes])
                slot ^= 1
            for s in streams:
                s.synchronize()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            if not is_aborted(exc):
                errors.append(exc)
            if check is not None:
                check.abort()
            for s in streams:
                s.synchronize()
        finally:
            pool.give(pair)

    threads = [threading.Thread(target=run, name=f"stage-gpu-{i}") for i in range(pool.pairs)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        files.close()
    if errors:
        exc = errors[0]
        if isinstance(exc, StagingError):
            raise exc
        raise StagingError(f"copy to GPU failed: {exc}") from exc
