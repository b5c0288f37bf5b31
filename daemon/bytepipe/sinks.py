"""The sinks a read feeds (daemon.bytepipe.engine): hashes, a check, device copies, a file writer.

* `Crcs`: the CRC32C of each chunk, in the reader thread that read it; joined per file at the end
  in file order (`crc32c_combine`), bytes no chunk covered (a safetensors header) read then.
* `InOrder`: a strong hash (BLAKE3 / SHA-256) per file, fed in file order without making a reader
  wait: a chunk that arrives early is parked (its buffer held); whoever delivers the next chunk
  hashes it and every parked chunk that follows.
* `Checked`: a `LoadCheck` (daemon.bytepipe.check), hashed on its per-file threads (`submit`,
  the buffer held until hashed) or in the reader thread (`feed`).
* `DeviceCopy`: each chunk copied to device tensors on the reader's own CUDA stream (made once per
  process), asynchronously: the buffer is reused once the copy's event completed, so the copy
  overlaps the hashing of the same pinned bytes. Without CUDA the copy is synchronous.
* `FileWriter`: each chunk written at its `dst` offset of an output file (a rebuilt checkpoint).
* `Progress`: a callback with each chunk's byte count.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from daemon.bytepipe.engine import Aborted, Buffer, Job
from daemon.crc import crc32c_combine, crc32c_shift
from daemon.hashing import crc32c_lib, new_strong_hash

__all__ = ["Checked", "Crcs", "DeviceCopy", "FileWriter", "InOrder", "Progress"]


class Crcs:
    """CRC32C per file from chunks in any order (also the loader's, staging with `verify_alg`)."""

    def __init__(self, chunk: int = 0) -> None:
        self._parts: dict[Path, list[tuple[int, int, int]]] = {}
        self._lock = threading.Lock()
        self._full = (chunk, crc32c_shift(chunk)) if chunk > 0 else (0, 0)

    def take(self, job: Job, data: memoryview, buffer: Buffer | None, reader: int) -> None:
        self.feed(job.file, job.offset, data)

    def feed(self, file: Path, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        crc = crc32c_lib().crc32c(view)
        with self._lock:
            self._parts.setdefault(file, []).append((offset, len(view), crc))

    def abort(self) -> None:
        return None

    def result(self, file: Path, size: int) -> str:
        """The CRC32C (8 hex) of the whole `size`-byte file; uncovered bytes are read from it."""
        parts = sorted(self._parts.get(file, []))
        total, pos, fd = 0, 0, -1
        try:
            for off, n, crc in [*parts, (size, 0, 0)]:
                if off < pos:
                    raise ValueError(f"{file}: staged chunks overlap at byte {off}")
                if off > pos:  # bytes no chunk staged (the header): read them for the CRC
                    if fd < 0:
                        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
                    gap = os.pread(fd, off - pos, pos)
                    if len(gap) != off - pos:
                        raise OSError(f"{file}: short read at byte {pos} computing its CRC32C")
                    total = crc32c_combine(total, crc32c_lib().crc32c(gap), len(gap))
                if n:
                    total = crc32c_combine(total, crc, n, shift=self._full[1] if n == self._full[0] else None)
                pos = off + n
        finally:
            if fd >= 0:
                os.close(fd)
        return f"{total:08x}"


class Holdable(Protocol):
    """A buffer a sink may keep past `take` (`hold`) and give back (`release`): an engine `Buffer`,
    a rebuild's chunk buffer (daemon.delta.container)."""

    def hold(self) -> None: ...

    def release(self) -> None: ...


class _Ordered:
    __slots__ = ("hasher", "pos", "busy", "parked", "lock")

    def __init__(self, hasher: Any) -> None:
        self.hasher = hasher
        self.pos = 0
        self.busy = False
        self.parked: dict[int, tuple[memoryview, Holdable | None]] = {}
        self.lock = threading.Lock()


class InOrder:
    """The strong hash of each file, fed in file order; a file's chunks must cover it from 0."""

    def __init__(self, files: Sequence[Path], alg: str, *, threads: int = 1) -> None:
        self.alg = alg
        self._files = {f: _Ordered(new_strong_hash(alg, threads=threads)) for f in files}
        self._aborted = False

    def take(self, job: Job, data: memoryview, buffer: Holdable | None, reader: int) -> None:
        st = self._files[job.file]
        with st.lock:
            if self._aborted:
                raise Aborted
            if buffer is not None:
                buffer.hold()
            st.parked[job.offset] = (data, buffer)
            if st.busy:
                return  # the thread hashing this file takes it in turn
            st.busy = True
        try:
            while True:
                with st.lock:
                    item = st.parked.pop(st.pos, None) if not self._aborted else None
                    if item is None:
                        st.busy = False
                        return
                view, buf = item
                try:
                    st.hasher.update(view)  # outside the lock: the hash releases the GIL
                finally:
                    if buf is not None:
                        buf.release()
                with st.lock:
                    st.pos += len(view)
        except BaseException:
            with st.lock:
                st.busy = False
            raise

    def abort(self) -> None:
        parked: list[Holdable | None] = []
        for st in self._files.values():
            with st.lock:
                self._aborted = True
                parked += [b for _v, b in st.parked.values()]
                st.parked.clear()
        for b in parked:
            if b is not None:
                b.release()

    def hashed(self, file: Path) -> int:
        return self._files[file].pos

    def hexdigest(self, file: Path) -> str:
        st = self._files[file]
        if st.parked:
            raise ValueError(f"{file}: chunks after byte {st.pos} were never hashed")
        return str(st.hasher.hexdigest())


class Checked:
    """Chunks to a LoadCheck: on its per-file hashing threads (`threaded`, the reader reads on and
    the buffer is held until hashed), or in the reader thread in file order (`feed`)."""

    def __init__(self, check: Any, *, threaded: bool = True) -> None:
        self.check = check
        self.threaded = threaded

    def take(self, job: Job, data: memoryview, buffer: Buffer | None, reader: int) -> None:
        if self.threaded and buffer is not None:
            buffer.hold()
            self.check.submit(job.file, job.offset, data, buffer.release)
        else:
            self.check.feed(job.file, job.offset, data)

    def abort(self) -> None:
        self.check.abort()


_streams: dict[tuple[int, int], Any] = {}
_streams_lock = threading.Lock()


def reader_stream(device: Any, reader: int) -> Any:
    """Reader `reader`'s side stream on `device`, made once per process (not once per read)."""
    import torch

    key = (device.index if device.index is not None else torch.cuda.current_device(), reader)
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = torch.cuda.Stream(device=device)
        return stream


class DeviceCopy:
    """Each chunk to device tensors: `targets(job)` names (destination, offset in the chunk,
    length) pairs. On a GPU the copy runs on the reader's stream and the buffer waits for it."""

    def __init__(self, targets: Callable[[Job], Sequence[tuple[Any, int, int]]]) -> None:
        self.targets = targets
        self._used: set[tuple[Any, int]] = set()
        self._lock = threading.Lock()

    def take(self, job: Job, data: memoryview, buffer: Buffer | None, reader: int) -> None:
        import torch

        src = buffer.tensor if buffer is not None and buffer.tensor is not None else torch.frombuffer(data, dtype=torch.uint8)
        for dst, start, n in self.targets(job):
            if dst.device.type == "cuda":
                stream = reader_stream(dst.device, reader)
                with self._lock:
                    self._used.add((dst.device, reader))
                with torch.cuda.stream(stream):
                    dst.copy_(src[start : start + n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                if buffer is not None:
                    buffer.after(ev)
                else:
                    ev.synchronize()
            else:
                dst.copy_(src[start : start + n])

    def finish(self, reader: int) -> None:
        """In reader `reader`'s thread as it stops: its copies are done."""
        with self._lock:
            mine = [d for d, r in self._used if r == reader]
        for d in mine:
            reader_stream(d, reader).synchronize()

    def abort(self) -> None:
        return None


class FileWriter:
    """Each chunk written at its `dst` offset of the file `fd` (opened by the caller)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def take(self, job: Job, data: memoryview, buffer: Buffer | None, reader: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], job.dst + done)

    def abort(self) -> None:
        return None


class Progress:
    def __init__(self, fn: Callable[[int], None]) -> None:
        self.fn = fn

    def take(self, job: Job, data: memoryview, buffer: Buffer | None, reader: int) -> None:
        self.fn(job.nbytes)

    def abort(self) -> None:
        return None
