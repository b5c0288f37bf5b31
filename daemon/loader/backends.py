"""The loader's staging machinery below the store: backends (shared host memory, GPUs), the
check of what is staged (the loader's own digests), and the errors and protocols they share."""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from daemon.bytepipe import Crcs, Expect, LoadCheck
from daemon.handoff import HOST_DEVICE, BufferRef, TensorSlot
from daemon.hashing import DEFAULT_HASH_ALG, HASH_ALGORITHMS, DigestMismatch
from daemon.loader.staging import (
    ChunkCheck,
    PinnedPool,
    ReadJob,
    StagingError,
    check_ranges,
    plan_reads,
    read_into_devices,
    read_into_host,
)

log = logging.getLogger("hotswap.loader")


def _pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 22  # the kernel's ceiling


PID_MAX = _pid_max()


def _pid_alive(pid: int) -> bool:
    if not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True
    return True


class StoreError(RuntimeError):
    """A loader request that cannot be honoured; the message is the reason given to the client."""


class StagedBuffer(Protocol):
    device_uuid: str
    nbytes: int

    def ref(self) -> BufferRef: ...
    def free(self) -> bool: ...


class Backend(Protocol):
    kind: str  # "shm" | "cuda"
    devices: list[str]

    def allocate(self, name: str, nbytes: int) -> list[StagedBuffer]: ...
    def fill(
        self, buffers: list[StagedBuffer], table: dict[str, Any], slots: tuple[TensorSlot, ...], check: StageCheck
    ) -> None: ...


HASH_FOR_VERIFY = HASH_ALGORITHMS  # what `stage(verify_alg=...)` may ask for


class StageCheck:
    """The loader's own digests of what it stages, computed while it reads (never the client's):
    compared with the reference files the daemon gave (the registry's), computed alone otherwise.
    `crcs`: also the CRC32C of every file (the daemon's verify staging here, `verify_alg`)."""

    def __init__(self, directory: Path, expect: Expect, threads: int, alg: str = DEFAULT_HASH_ALG,
                 crcs: Crcs | None = None) -> None:  # fmt: skip
        self.directory = directory
        self.expect = expect
        self.threads = threads
        self.alg = alg
        self.crcs = crcs
        self.check: LoadCheck | None = None

    def start(self, jobs: list[ReadJob]) -> ChunkCheck:
        try:
            self.check = LoadCheck(self.directory, self.expect, check_ranges(jobs), threads=self.threads,
                                   compute_alg=self.alg if not self.expect.files else None)  # fmt: skip
        except (DigestMismatch, OSError) as exc:
            raise StagingError(f"check while staging: {exc}") from None
        return self.check if self.crcs is None else _Tee(self.check, self.crcs)

    def finish(self) -> tuple[tuple[tuple[str, int, str, str], ...], bool]:
        """(path, bytes, alg, hex) per file, and whether every file matched a reference."""
        assert self.check is not None
        try:
            self.check.finish()
        except (DigestMismatch, OSError) as exc:
            raise StagingError(f"check while staging: {exc}") from None
        finally:
            self.check.close()
        files = tuple(
            (path, d.bytes, d.hash_alg or "crc32c", d.hash or d.crc32c) for path, d in sorted(self.check.digests.items())
        )
        return files, self.check.compared and not self.check.weak


class _Tee:
    """Each staged chunk to the strong-hash check and to the CRC32C of its file."""

    def __init__(self, check: LoadCheck, crcs: Crcs) -> None:
        self.check, self.crcs = check, crcs

    def feed(self, file: Path, offset: int, data: Any) -> None:
        self.crcs.feed(file, offset, data)
        self.check.feed(file, offset, data)

    def abort(self) -> None:
        self.check.abort()


# ---- shared host memory ------------------------------------------------------------------


class _ShmBuffer:
    def __init__(self, segment: Any) -> None:
        self.segment = segment
        self.device_uuid = HOST_DEVICE
        self.nbytes = segment.nbytes

    def ref(self) -> BufferRef:
        return BufferRef(HOST_DEVICE, self.nbytes, 0, path=str(self.segment.path))

    def free(self) -> bool:
        self.segment.unlink()
        return True


class ShmBackend:
    kind = "shm"

    def __init__(self, directory: Path, threads: int = 8) -> None:
        self.directory = directory
        self.threads = threads
        self.devices = [HOST_DEVICE]
        self._seq = itertools.count(1)  # next() is atomic: concurrent stages get distinct names

    def allocate(self, name: str, nbytes: int) -> list[StagedBuffer]:
        from daemon.handoff import ShmSegment, segment_name

        seq = next(self._seq)
        return [_ShmBuffer(ShmSegment(self.directory, segment_name(os.getpid(), seq, name), nbytes))]

    def fill(
        self, buffers: list[StagedBuffer], table: dict[str, Any], slots: tuple[TensorSlot, ...], check: StageCheck
    ) -> None:
        (buf,) = buffers
        assert isinstance(buf, _ShmBuffer)
        view = buf.segment.view()
        jobs = plan_reads(table, slots)
        try:
            read_into_host(jobs, view, self.threads, check.start(jobs))
        finally:
            view.release()
        buf.segment.seal()

    def cleanup_stale(self) -> list[str]:
        """Remove segments left by loaders that died without cleaning up (SIGKILL, OOM)."""
        from daemon.handoff import segment_owner

        removed: list[str] = []
        for p in self.directory.iterdir():
            pid = segment_owner(p.name)
            if pid is None or pid == os.getpid() or _pid_alive(pid):
                continue
            try:
                p.unlink()
                removed.append(p.name)
            except OSError as exc:
                log.warning("cannot remove stale segment %s: %s", p, exc)
        return removed


# ---- GPUs --------------------------------------------------------------------------------


class _CudaBuffer:
    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.device_uuid = buf.device_uuid
        self.nbytes = buf.nbytes

    def ref(self) -> BufferRef:
        return BufferRef(self.device_uuid, self.nbytes, 0, handle=self.buf.ipc_handle())

    def free(self) -> bool:
        return bool(self.buf.free())


class CudaBackend:
    kind = "cuda"

    def __init__(self, indices: list[int], threads: int = 8) -> None:
        from daemon.handoff import device_uuid

        self.indices = indices
        self.devices = [device_uuid(i) for i in indices]
        self.threads = threads
        self._pool: PinnedPool | None = None

    def allocate(self, name: str, nbytes: int) -> list[StagedBuffer]:
        from daemon.handoff import CudaIpcError, DeviceBuffer

        out: list[StagedBuffer] = []
        try:
            for i in self.indices:
                out.append(_CudaBuffer(DeviceBuffer(i, nbytes)))
        except CudaIpcError as exc:
            for b in out:
                b.free()
            raise StoreError(f"cannot allocate {nbytes} bytes for {name} on GPU {i}: {exc}") from None
        return out

    def fill(
        self, buffers: list[StagedBuffer], table: dict[str, Any], slots: tuple[TensorSlot, ...], check: StageCheck
    ) -> None:
        if self._pool is None:
            self._pool = PinnedPool(self.threads)
        dests = [b.buf.tensor() for b in buffers if isinstance(b, _CudaBuffer)]
        jobs = plan_reads(table, slots, chunk=self._pool.chunk)
        read_into_devices(jobs, dests, self._pool, check.start(jobs))
