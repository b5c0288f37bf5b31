"""Check while reading: hash every byte a transport or the loader reads and compare with what verify recorded.

The registry's per-file digests (`Expect.files`, filled by the daemon for every update it sends)
are the reference. A transport that reads a checkpoint in chunks, from several threads, feeds
each chunk to the `LoadCheck`; per file, an `OrderedHasher` hashes the chunks in file order
(a chunk waits until every earlier byte of its file was hashed; bytes no chunk covers, such as
the safetensors header, are read by the hasher itself), so the result is the hash of the whole
file exactly as verify computed it. `finish()` compares every file with its reference and raises
`DigestMismatch` (the caller then restores the previous weights and commits nothing).

Off the readers' critical path (`submit`): a reader hands over a chunk it has read (and started
copying to the GPU) together with a `done` callback, and goes on reading; one hashing thread per
file takes the chunks in file order and calls `done` once a chunk is hashed (the reader may
then reuse that buffer). `finish()` waits for every file's hash, then compares, so nothing is
committed (and the worker does not resume) before every byte was checked.

The strong hash (BLAKE3 or SHA-256) decides; files the registry knows only by CRC32C (format-1
rows) are checked by CRC and reported as `weak`. Hashing releases the GIL, and BLAKE3 splits
each chunk over `threads` cores, so files hash in parallel with the reads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from daemon.bytepipe.engine import Aborted
from daemon.bytepipe.expect import Expect, Reference, reference_for
from daemon.hashing import DigestMismatch, FileDigest, crc32c_lib, new_strong_hash

__all__ = ["DigestMismatch", "LoadCheck", "OrderedHasher", "Reference", "ensure_contained", "is_aborted",
           "reference_for", "wants_check"]


class OrderedHasher:
    """The digest of one file, fed chunks from any thread in any order; hashed in file order.

    `covered` are the (offset, length) ranges that chunks will deliver; every other byte of the
    file (header, gaps, tail) is read here with `pread` when the hash reaches it.
    """

    def __init__(self, path: Path, ref: Reference, covered: Iterable[tuple[int, int]], *, threads: int = 1) -> None:
        self.path = path
        self.ref = ref
        self._strong = new_strong_hash(ref.alg, threads=threads) if ref.strong else None
        self._crc = 0
        self._pos = 0
        self._busy = False
        self._aborted = False
        self._cond = threading.Condition()
        self._starts: dict[int, int] = {}
        for off, n in sorted(covered):
            if n > 0:
                self._starts[off] = n
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._size = os.fstat(self._fd).st_size
        if ref.value and self._size != ref.bytes:
            os.close(self._fd)
            raise DigestMismatch(f"{ref.path}: {self._size} bytes now, {ref.bytes} verified (changed since verify)")

    def _update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if self._strong is not None:
            self._strong.update(view)
        else:
            self._crc = crc32c_lib().crc32c(view, self._crc)

    def _fill_gaps(self) -> None:
        """Hash bytes no chunk covers, read from the file itself, up to the next covered range."""
        while self._pos not in self._starts and self._pos < self._size:
            later = [s for s in self._starts if s > self._pos]
            end = min(later) if later else self._size
            n = end - self._pos
            if n <= 0:
                return
            data = os.pread(self._fd, n, self._pos)
            if len(data) != n:
                raise DigestMismatch(f"{self.path}: short read at byte {self._pos} (file changed while loading?)")
            self._update(data)
            self._pos += n

    def feed(self, offset: int, data: Any) -> None:
        """Hash `data`, the file's bytes at `offset`, once every earlier byte is hashed."""
        with self._cond:
            self._fill_gaps()
            while not self._aborted and (self._busy or self._pos != offset):
                if self._pos > offset:
                    raise DigestMismatch(f"{self.path}: bytes at {offset} fed twice")
                self._cond.wait()
            if self._aborted:
                raise Aborted
            self._busy = True
        try:
            self._update(data)  # outside the lock: the hash releases the GIL
        finally:
            with self._cond:
                self._busy = False
                self._pos = offset + len(memoryview(data).cast("B"))
                self._starts.pop(offset, None)
                if not self._aborted:
                    self._fill_gaps()
                self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def next_offset(self) -> int | None:
        """Where the next chunk must start (earlier uncovered bytes hashed first); None when no
        covered range is left."""
        with self._cond:
            self._fill_gaps()
            return self._pos if self._pos in self._starts else None

    def result(self) -> FileDigest:
        with self._cond:
            self._fill_gaps()
            size_now = os.fstat(self._fd).st_size
        hexd = self._strong.hexdigest() if self._strong is not None else ""
        crc = "" if self._strong is not None else f"{self._crc:08x}"
        return FileDigest(max(self._pos, size_now), crc, self.ref.alg if self._strong is not None else None, hexd)

    def check(self) -> FileDigest:
        """The file's digest; raises DigestMismatch unless it equals the reference (when there is one)."""
        if self._starts:
            raise DigestMismatch(f"{self.path}: {len(self._starts)} ranges were never read")
        d = self.result()
        if not self.ref.value:
            return d  # computed only (the loader without a reference): reported, not compared
        if d.bytes != self.ref.bytes:
            raise DigestMismatch(f"{self.ref.path}: {d.bytes} bytes now, {self.ref.bytes} verified")
        got = d.hash if self.ref.strong else d.crc32c
        if got != self.ref.value:
            raise DigestMismatch(
                f"{self.ref.path}: {self.ref.alg} {got[:16]}... does not match the verified {self.ref.value[:16]}... "
                "(changed since it was verified)"
            )
        return d

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


Done = Callable[[], None]


class _FileThread:
    """Hashes one file's submitted chunks in file order on a thread of its own; `done` of every
    chunk is called once it is hashed (or once hashing stopped: abort, error)."""

    def __init__(self, hasher: OrderedHasher) -> None:
        self.hasher = hasher
        self.error: BaseException | None = None
        self._pending: dict[int, tuple[Any, Done]] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"hash-{hasher.path.name}", daemon=True)
        self._thread.start()

    def submit(self, offset: int, data: Any, done: Done) -> None:
        with self._cond:
            if self._stopped:
                done()
                return
            self._pending[offset] = (data, done)
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            while True:
                nxt = self.hasher.next_offset()
                if nxt is None:
                    return  # every covered range hashed
                with self._cond:
                    while nxt not in self._pending and not self._stopped:
                        self._cond.wait()
                    if self._stopped:
                        return
                    data, done = self._pending.pop(nxt)
                try:
                    self.hasher.feed(nxt, data)
                finally:
                    done()
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            if not is_aborted(exc):
                self.error = exc
        finally:
            self.stop()

    def stop(self) -> None:
        """No more hashing: release every waiting chunk (their readers go on) and let go."""
        with self._cond:
            self._stopped = True
            pending, self._pending = self._pending, {}
            self._cond.notify_all()
        for _data, done in pending.values():
            done()

    def join(self) -> None:
        self._thread.join()


class LoadCheck:
    """Every file a transport reads, checked against the registry's digests; see the module docstring."""

    def __init__(
        self,
        directory: Path,
        expect: Expect,
        ranges: Mapping[Path, Iterable[tuple[int, int]]],
        *,
        threads: int = 1,
        compute_alg: str | None = None,
    ) -> None:
        """`compute_alg`: hash files the reference does not list with this algorithm instead of
        refusing them (the loader staged without a reference reports what it computed)."""
        self.directory = directory
        refs: dict[str, Reference] = {}
        for f in expect.files:
            ref = reference_for(f)
            if ref is not None:
                refs[f.path] = ref
        self.hashers: dict[Path, OrderedHasher] = {}
        self._threads: dict[Path, _FileThread] = {}
        self._threads_lock = threading.Lock()
        try:
            for file, covered in ranges.items():
                rel = _relative(directory, file)
                ref = refs.get(rel)
                if ref is None and compute_alg is not None:
                    ref = Reference(rel, 0, compute_alg, "")
                if ref is None:
                    raise DigestMismatch(f"{rel}: the registry has no verified digest for this file")
                self.hashers[file] = OrderedHasher(file, ref, covered, threads=threads)
            read = {_relative(directory, f) for f in ranges}
            unread = sorted(p for p in refs if p.endswith(".safetensors") and p not in read)
            if unread:
                raise DigestMismatch(f"{unread[0]}: verified weight file is not part of the checkpoint being loaded")
        except BaseException:
            self.close()
            raise
        self.weak = any(not h.ref.strong for h in self.hashers.values())
        self.digests: dict[str, FileDigest] = {}

    def feed(self, file: Path, offset: int, data: Any) -> None:
        """Hash in the caller's thread (blocks until every earlier byte of the file is hashed)."""
        self.hashers[file].feed(offset, data)

    def submit(self, file: Path, offset: int, data: Any, done: Done) -> None:
        """Hash on the file's own thread; `data` must stay unchanged until `done()` is called."""
        with self._threads_lock:
            t = self._threads.get(file)
            if t is None:
                t = self._threads[file] = _FileThread(self.hashers[file])
        t.submit(offset, data, done)

    def abort(self) -> None:
        for h in self.hashers.values():
            h.abort()
        for t in list(self._threads.values()):
            t.stop()

    def finish(self) -> dict[str, Any]:
        """Wait for every file's hash; raise DigestMismatch unless every file matched; returns
        facts for the update's answer."""
        for t in list(self._threads.values()):
            t.join()
        for t in self._threads.values():
            if t.error is not None:
                raise t.error
        self.digests = {_relative(self.directory, f): h.check() for f, h in self.hashers.items()}
        algs = sorted({h.ref.alg for h in self.hashers.values()})
        return {"checked_files": len(self.hashers), "check_alg": ",".join(algs), "check_weak": self.weak}

    @property
    def compared(self) -> bool:
        """Every file had a reference to compare with (not only computed)."""
        return all(h.ref.value for h in self.hashers.values())

    def close(self) -> None:
        for t in list(self._threads.values()):
            t.stop()
            t.join()
        for h in self.hashers.values():
            h.close()


def ensure_contained(directory: Path, files: Iterable[Path]) -> None:
    """Every weight file must be a regular file that stays inside the checkpoint directory
    (symlinks within it are fine). A symlink to /etc/shadow is refused by name before a byte of
    it is read, so no error message can carry the bytes (or the header length) of such a file."""
    root = os.path.realpath(directory)
    for f in files:
        real = os.path.realpath(f)
        if os.path.commonpath([root, real]) != root:
            raise DigestMismatch(f"{_relative(directory, f)}: a symlink leaving the checkpoint directory; refused")
        if os.path.exists(real) and not os.path.isfile(real):
            raise DigestMismatch(f"{_relative(directory, f)}: not a regular file; refused")


def _relative(directory: Path, file: Path) -> str:
    try:
        return file.relative_to(directory).as_posix()
    except ValueError:
        return file.name


def is_aborted(exc: BaseException) -> bool:
    return isinstance(exc, Aborted)


def wants_check(expect: Expect) -> bool:
    """True when the request carries per-file digests to check against."""
    return any(reference_for(f) is not None for f in expect.files)
