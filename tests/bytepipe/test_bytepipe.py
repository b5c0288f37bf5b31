"""The byte pipeline itself (daemon.bytepipe): one read feeds every sink, memory stays bounded by
the pool, a file writer rebuilds the file, and the first error stops every reader."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import blake3
import crc32c
import pytest

from daemon.bytepipe.engine import Buffer, BufferPool, Job, OpenFiles, pread_exact, run
from daemon.bytepipe.files import plan, read_files
from daemon.bytepipe.sinks import Crcs, FileWriter, InOrder

pytestmark = pytest.mark.quick


class _InFlight:
    """Counts buffers held at once (by this sink, from take until a later reader's release)."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self.most = 0
        self.lock = threading.Lock()

    def take(self, job: Job, data: memoryview, buffer: Buffer | None, reader: int) -> None:
        with self.lock:
            self.most = max(self.most, len(self.pool.buffers) - len(self.pool._free))

    def abort(self) -> None:
        return None


def _files(tmp_path: Path, sizes: list[int]) -> list[Path]:
    out = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(os.urandom(n))
        out.append(p)
    return out


def test_one_read_feeds_crc_strong_hash_and_a_file_writer_with_at_most_the_pool_in_flight(tmp_path: Path) -> None:
    paths = _files(tmp_path, [300_001, 70_000, 0, 4096])
    sizes = [p.stat().st_size for p in paths]
    bases = [0, 400_000, 500_000, 600_000]
    files = OpenFiles(paths)
    out = tmp_path / "rebuilt.bin"
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o600)
    pool = BufferPool(3, 4096)
    crcs, strong, flight = Crcs(4096), InOrder(paths, "blake3"), _InFlight(pool)
    try:
        def read(job: Job, view: memoryview) -> None:
            assert pread_exact(files.fds[job.file], view, job.offset) == job.nbytes

        run(plan(paths, sizes, 4096, bases), [crcs, strong, FileWriter(fd), flight], read, readers=4, pool=pool)
    finally:
        os.close(fd)
        files.close()
        pool.close()
    rebuilt = out.read_bytes()
    for p, base in zip(paths, bases, strict=True):
        data = p.read_bytes()
        assert crcs.result(p, len(data)) == f"{crc32c.crc32c(data):08x}"
        assert strong.hexdigest(p) == blake3.blake3(data).hexdigest()
        assert rebuilt[base : base + len(data)] == data
    assert 1 <= flight.most <= 3  # never more buffers in flight than the pool holds


def test_the_first_error_stops_every_reader_and_is_raised(tmp_path: Path) -> None:
    paths = _files(tmp_path, [64 * 4096, 64 * 4096])
    seen: list[int] = []

    class Failing:
        def take(self, job: Job, data: memoryview, buffer: Buffer | None, reader: int) -> None:
            seen.append(job.offset)
            if len(seen) == 5:
                raise ValueError("sink refused chunk five")

        def abort(self) -> None:
            return None

    with pytest.raises(ValueError, match="sink refused chunk five"):
        read_files(paths, [p.name for p in paths], alg="sha256", crc=True, threads=3, chunk=4096, extra=[Failing()])
    assert len(seen) < 128  # stopped early, not after reading everything
    # the same files read again in full still hash right (nothing left over from the failed run)
    got = read_files(paths, [p.name for p in paths], alg="sha256", crc=False, threads=3, chunk=4096)
    assert [d.hash for d in got] == [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


def test_pinned_buffers_of_two_sizes_are_taken_from_the_free_list_by_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool of 8 MiB chunks given back, then one of 16 MiB and one that fits in either: the free
    list holds both sizes, and taking a larger one behind a smaller must not compare tensors (the
    H100 run of 2026-12-07: "The size of tensor a (8388608) must match ... (16777216)")."""
    torch = pytest.importorskip("torch")
    from daemon.bytepipe import engine

    small, large, other = torch.zeros(8), torch.zeros(16), torch.zeros(16)
    monkeypatch.setattr(engine, "_PINNED", [small, large, other])
    taken = engine._take_pinned(1, 12)  # only the 16-element ones fit; the first of them
    assert len(taken) == 1 and taken[0] is large
    assert [id(b) for b in engine._PINNED] == [id(small), id(other)]
