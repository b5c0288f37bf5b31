"""The one read: files into reused buffers by several reader threads, each buffer handed to sinks.

A run takes a list of `Job`s (a byte range of a file, and where those bytes belong in a
destination) and a list of sinks. Each reader thread takes a free buffer from the `BufferPool`
first, then the next job (so a reader that waits holds no job and every job in flight has its
buffer), `pread`s the range into the buffer (the GIL is released) and calls every sink's
`take(job, data, buffer, reader)` in turn. A sink that needs the bytes after `take` returns (a
hash that must wait for an earlier chunk of its file, a copy still running on a device stream)
holds the buffer (`Buffer.hold` / `release`, `Buffer.after(event)`); a buffer goes back to the
pool only once every holder let it go and its device copies finished. The pool's size is the cap
on buffers in flight, so memory stays bounded however large the files are.

With `into` (a destination in host memory: shared memory, a CPU staging tensor, CPU parameters)
the reader reads straight into the destination and no pool buffer is used.

The first error stops every reader and aborts every sink (a sink waiting on a file's hash order
is woken); `run` waits until every buffer is back, then raises that error (errors raised only
because a sink was aborted, `Aborted`, give way to the error that caused the abort).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Aborted", "Buffer", "BufferPool", "Job", "OpenFiles", "Sink", "pread_exact", "run"]


class Aborted(Exception):
    """Raised in a thread that waited on work another thread gave up (the first error says why)."""


@dataclass(frozen=True, slots=True)
class Job:
    """Bytes [offset, offset + nbytes) of `file`; `dst` is where they go in a flat destination,
    `tag` what a sink needs besides (the tensor segments a chunk carries)."""

    file: Path
    offset: int
    nbytes: int
    dst: int = 0
    tag: Any = None


class Buffer:
    """One reusable buffer of a pool: `view` (a writable memoryview) and, when pinned, `tensor`."""

    __slots__ = ("view", "tensor", "_pool", "_holds", "_events")

    def __init__(self, pool: BufferPool, view: memoryview, tensor: Any) -> None:
        self._pool = pool
        self.view = view
        self.tensor = tensor
        self._holds = 0
        self._events: list[Any] = []

    def hold(self) -> None:
        """Keep this buffer out of the pool until a matching `release`."""
        with self._pool._cond:
            self._holds += 1

    def release(self) -> None:
        self._pool._release(self)

    def after(self, event: Any) -> None:
        """Reuse only once `event` (a CUDA event recorded after a copy out of this buffer) completed."""
        with self._pool._cond:
            self._events.append(event)


# page-locked host memory is slow to allocate: kept for the process, lent to one run at a time
_PINNED: list[Any] = []
_PINNED_LOCK = threading.Lock()


class BufferPool:
    """`count` buffers of `nbytes`: the cap on buffers in flight. `pinned`: page-locked torch
    tensors (the source of fast, asynchronous host->device copies), taken from the process's
    free list and given back by `close`; otherwise plain bytearrays (no torch needed)."""

    def __init__(self, count: int, nbytes: int, *, pinned: bool = False) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        self._cond = threading.Condition()
        self._tensors: list[Any] = []
        if pinned:
            self._tensors = _take_pinned(count, nbytes)
            self.buffers = [Buffer(self, memoryview(t.numpy()).cast("B")[:nbytes], t) for t in self._tensors]
        else:
            self.buffers = [Buffer(self, memoryview(bytearray(nbytes)), None) for _ in range(count)]
        self._free = list(reversed(self.buffers))

    def take(self, stop: threading.Event) -> Buffer | None:
        """A free buffer (its earlier device copies finished); None once `stop` is set."""
        with self._cond:
            while not self._free and not stop.is_set():
                self._cond.wait()
            if stop.is_set():
                return None
            buf = self._free.pop()
            events, buf._events = buf._events, []
            buf._holds = 1
        for ev in events:
            ev.synchronize()
        return buf

    def _release(self, buf: Buffer) -> None:
        with self._cond:
            buf._holds -= 1
            if buf._holds == 0:
                self._free.append(buf)
                self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every buffer is back and no device copy reads one any more."""
        with self._cond:
            while len(self._free) < len(self.buffers):
                self._cond.wait()
            events = [ev for b in self.buffers for ev in b._events]
            for b in self.buffers:
                b._events = []
        for ev in events:
            ev.synchronize()

    def close(self) -> None:
        """Drain, then give pinned memory back to the process's free list for the next run."""
        self.drain()
        if self._tensors:
            with _PINNED_LOCK:
                _PINNED.extend(self._tensors)
            self._tensors = []


def _take_pinned(n: int, nbytes: int) -> list[Any]:
    import torch

    with _PINNED_LOCK:
        taken = [b for b in _PINNED if b.numel() >= nbytes][:n]
        # by identity: list.remove compares with ==, elementwise on tensors, which raises once the
        # free list holds buffers of two sizes (a pool of 8 MiB chunks, then one of 16 MiB)
        kept = {id(b) for b in taken}
        _PINNED[:] = [b for b in _PINNED if id(b) not in kept]
    while len(taken) < n:
        taken.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
    return taken


def pinned_bytes() -> int:
    """Page-locked host memory this process keeps for the pools (free now)."""
    with _PINNED_LOCK:
        return sum(int(b.numel()) for b in _PINNED)


class Sink(Protocol):
    """What receives each chunk. `take` runs in the reader thread that read it; a sink keeping
    the bytes past `take` holds `buffer` (None when the reader read straight into a destination)."""

    def take(self, job: Job, data: memoryview, buffer: Buffer | None, reader: int) -> None: ...

    def abort(self) -> None: ...


def pread_exact(fd: int, view: memoryview, pos: int) -> int:
    """Read len(view) bytes at `pos`; returns how many arrived (fewer only at the end of the file)."""
    got, n = 0, len(view)
    while got < n:
        r = os.preadv(fd, [view[got:]], pos + got)
        if r <= 0:
            break
        got += r
    return got


class OpenFiles:
    """One read-only descriptor per file, shared by the readers (pread has no cursor).
    `regular`: refuse anything but a regular file (opened O_NONBLOCK, so a FIFO cannot hang us);
    `error(path, exc)` makes the error an opening failure raises."""

    def __init__(self, paths: Iterable[Path], *, regular: bool = True, sequential: bool = False,
                 error: Callable[[Path, OSError], BaseException] | None = None) -> None:  # fmt: skip
        self.fds: dict[Path, int] = {}
        self.sizes: dict[Path, int] = {}
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (os.O_NONBLOCK if regular else 0)
        try:
            for p in paths:
                if p in self.fds:
                    continue
                try:
                    fd = os.open(p, flags)
                except OSError as exc:
                    raise (error(p, exc) if error else exc) from None
                self.fds[p] = fd
                st = os.fstat(fd)
                if regular and not stat.S_ISREG(st.st_mode):
                    raise (error(p, OSError(f"{p}: not a regular file")) if error else OSError(f"{p}: not a regular file"))
                self.sizes[p] = st.st_size
                if sequential:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead (cold reads)
        except BaseException:
            self.close()
            raise

    def size_now(self, path: Path) -> int:
        return os.fstat(self.fds[path]).st_size

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def run(
    jobs: Sequence[Job],
    sinks: Sequence[Sink],
    read: Callable[[Job, memoryview], None],
    *,
    readers: int,
    pool: BufferPool | None = None,
    into: Callable[[Job], memoryview] | None = None,
    on_exit: Callable[[int], None] | None = None,
) -> None:
    """Read every job once (`read(job, view)` fills the view or raises) and hand it to every sink,
    in `readers` threads; buffers from `pool`, or straight into `into(job)`. `on_exit(reader)` runs
    in each reader thread as it stops (a device stream's last synchronize). Raises the first error."""
    if pool is None and into is None:
        raise ValueError("a run needs a buffer pool or a destination to read into")
    stop = threading.Event()
    errors: list[BaseException] = []
    lock = threading.Lock()
    cursor = iter(jobs)

    def fail(exc: BaseException) -> None:
        with lock:
            errors.append(exc)
        stop.set()
        if pool is not None:
            pool.wake()
        for s in sinks:
            with contextlib.suppress(Exception):  # the first error is the one reported
                s.abort()

    def work(r: int) -> None:
        try:
            while not stop.is_set():
                buf = pool.take(stop) if into is None and pool is not None else None
                if into is None and buf is None:
                    return
                try:
                    with lock:
                        job = next(cursor, None)
                    if job is None:
                        return
                    view = into(job) if into is not None else buf.view[: job.nbytes]  # type: ignore[union-attr]
                    read(job, view)
                    for s in sinks:
                        s.take(job, view, buf, r)
                finally:
                    if buf is not None:
                        buf.release()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            fail(exc)
        finally:
            if on_exit is not None:
                try:
                    on_exit(r)
                except BaseException as exc:  # noqa: BLE001
                    fail(exc)

    n = max(1, min(readers, len(jobs)))
    threads = [threading.Thread(target=work, args=(r,), name=f"bytepipe-read-{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if pool is not None:
        pool.drain()  # the sinks let every buffer go (aborted ones too) before the caller reuses them
    if errors:
        raise next((e for e in errors if not isinstance(e, Aborted)), errors[0])
