"""Staged versions held by the loader: one flat buffer per device, a budget, and who holds what.

Policy, "serving + last good + one incoming": at most `max_versions` (3) versions resident
and at most `budget_bytes` per device. Staging a new version first evicts the least recently
used versions that no worker holds; a version some worker holds (acquired and not released,
by a process that is still alive) is never freed, and if no room can be made the stage is
refused with the reason. Versions are immutable once staged: staging the same version again
from the same directory returns the existing one, from another directory is refused.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from daemon.formats.checkpoint import tensor_table
from daemon.loader.staging import PinnedPool, plan_reads, read_into_devices, read_into_host
from daemon.transport.ipc_descriptor import (
    ALIGN,
    HOST_DEVICE,
    MAX_VERSION_CHARS,
    BufferRef,
    Descriptor,
    TensorSlot,
    align_up,
    layout_tensors,
)

log = logging.getLogger("hotswap.loader")


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
    def fill(self, buffers: list[StagedBuffer], table: dict[str, Any], slots: tuple[TensorSlot, ...]) -> None: ...


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
        from daemon.transport.ipc_shm import ShmSegment, segment_name

        seq = next(self._seq)
        return [_ShmBuffer(ShmSegment(self.directory, segment_name(os.getpid(), seq, name), nbytes))]

    def fill(self, buffers: list[StagedBuffer], table: dict[str, Any], slots: tuple[TensorSlot, ...]) -> None:
        (buf,) = buffers
        assert isinstance(buf, _ShmBuffer)
        view = buf.segment.view()
        try:
            read_into_host(plan_reads(table, slots), view, self.threads)
        finally:
            view.release()
        buf.segment.seal()

    def cleanup_stale(self) -> list[str]:
        """Remove segments left by loaders that died without cleaning up (SIGKILL, OOM)."""
        from daemon.transport.ipc_shm import segment_owner

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
        from daemon.transport.ipc_cuda import device_uuid

        self.indices = indices
        self.devices = [device_uuid(i) for i in indices]
        self.threads = threads
        self._pool: PinnedPool | None = None

    def allocate(self, name: str, nbytes: int) -> list[StagedBuffer]:
        from daemon.transport.ipc_cuda import CudaIpcError, DeviceBuffer

        out: list[StagedBuffer] = []
        try:
            for i in self.indices:
                out.append(_CudaBuffer(DeviceBuffer(i, nbytes)))
        except CudaIpcError as exc:
            for b in out:
                b.free()
            raise StoreError(f"cannot allocate {nbytes} bytes for {name} on GPU {i}: {exc}") from None
        return out

    def fill(self, buffers: list[StagedBuffer], table: dict[str, Any], slots: tuple[TensorSlot, ...]) -> None:
        if self._pool is None:
            self._pool = PinnedPool(self.threads)
        dests = [b.buf.tensor() for b in buffers if isinstance(b, _CudaBuffer)]
        read_into_devices(plan_reads(table, slots, chunk=self._pool.chunk), dests, self._pool)


# ---- the store ---------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Holder:
    count: int
    pid: int | None


@dataclass
class StagedVersion:
    version: str
    path: Path
    digest: str | None
    slots: tuple[TensorSlot, ...]
    size: int
    buffer_bytes: int
    state: str = "staging"  # staging | ready
    buffers: list[StagedBuffer] = field(default_factory=list)
    holders: dict[str, Holder] = field(default_factory=dict)
    staged_at: float = 0.0
    last_used: float = 0.0
    exported: bool = False
    seconds: float = 0.0

    def live_holders(self) -> dict[str, Holder]:
        for worker, h in list(self.holders.items()):
            if h.pid is not None and not _pid_alive(h.pid):
                log.warning("worker %s (pid %d) died holding %s; released", worker, h.pid, self.version)
                del self.holders[worker]
        return self.holders


class LoaderStore:
    def __init__(
        self,
        backend: Backend,
        *,
        budget_bytes: int | None = None,
        max_versions: int = 3,
        socket_path: str | None = None,
    ) -> None:
        if max_versions < 1:
            raise StoreError("max_versions must be at least 1")
        self.backend = backend
        self.budget_bytes = budget_bytes
        self.max_versions = max_versions
        self.socket_path = socket_path
        self._versions: dict[str, StagedVersion] = {}
        self._lock = threading.Lock()

    # -- stage ---------------------------------------------------------------------------

    def stage(self, version: str, path: str, digest: str | None = None) -> dict[str, Any]:
        if not version or len(version) > MAX_VERSION_CHARS or "\x00" in version:
            raise StoreError(f"bad version label {version!r}")
        directory = Path(path)
        with self._lock:
            existing = self._versions.get(version)
            if existing is not None:
                return self._existing(existing, directory)
        if not directory.is_dir():
            raise StoreError(f"{directory}: not a checkpoint directory")
        table, _headers = tensor_table(directory)  # strict headers; LayoutError/HeaderError name the file
        order = sorted(table.values(), key=lambda loc: (str(loc.file), loc.entry.start))
        slots, size = layout_tensors((loc.entry.name, loc.entry.dtype, loc.entry.shape) for loc in order)
        entry = StagedVersion(version, directory, digest, slots, size, max(align_up(size), ALIGN))
        with self._lock:
            existing = self._versions.get(version)
            if existing is not None:
                return self._existing(existing, directory)
            self._make_room(entry.buffer_bytes, version)
            self._versions[version] = entry
        t0 = time.perf_counter()
        try:
            entry.buffers = self.backend.allocate(version, entry.buffer_bytes)
            self.backend.fill(entry.buffers, table, slots)
        except BaseException:
            with self._lock:
                self._versions.pop(version, None)
            for b in entry.buffers:
                b.free()
            raise
        with self._lock:
            entry.state = "ready"
            entry.staged_at = entry.last_used = time.time()
            entry.seconds = time.perf_counter() - t0
        log.info("staged %s: %d tensors, %d bytes in %.2f s", version, len(slots), size, entry.seconds)
        return self._info(entry)

    def _existing(self, v: StagedVersion, directory: Path) -> dict[str, Any]:
        if v.path.resolve() != directory.resolve():
            raise StoreError(
                f"version {v.version!r} is already staged from {v.path}; versions are immutable, "
                f"stage {directory} under another label"
            )
        if v.state != "ready":
            raise StoreError(f"version {v.version!r} is still staging")
        return self._info(v)

    def _info(self, v: StagedVersion) -> dict[str, Any]:
        return {
            "version": v.version,
            "bytes": sum(s.nbytes for s in v.slots),
            "tensors": len(v.slots),
            "devices": list(self.backend.devices),
            "seconds": round(v.seconds, 6),
        }

    def _make_room(self, need: int, incoming: str) -> None:
        """Evict least recently used, unheld versions until `need` bytes and one slot are free."""
        if self.budget_bytes is not None and need > self.budget_bytes:
            raise StoreError(f"version {incoming!r} needs {need} bytes per device, the budget is {self.budget_bytes}")
        while True:
            used = sum(v.buffer_bytes for v in self._versions.values())
            over_bytes = self.budget_bytes is not None and used + need > self.budget_bytes
            over_count = len(self._versions) + 1 > self.max_versions
            if not over_bytes and not over_count:
                return
            candidates = [v for v in self._versions.values() if v.state == "ready" and not v.live_holders()]
            if not candidates:
                held = ", ".join(
                    f"{v.version} ({v.state}, held by {sorted(v.holders) or 'nobody'})" for v in self._versions.values()
                )
                raise StoreError(
                    f"no room to stage {incoming!r} ({need} bytes): budget {self.budget_bytes}, used {used}, "
                    f"{len(self._versions)}/{self.max_versions} versions resident, none free to evict: {held}"
                )
            victim = min(candidates, key=lambda v: v.last_used)
            log.info("evicting %s to make room for %s", victim.version, incoming)
            self._free(victim)

    def _free(self, v: StagedVersion) -> bool:
        self._versions.pop(v.version, None)
        freed = all([b.free() for b in v.buffers])
        v.buffers = []
        return freed

    # -- export and accounting -------------------------------------------------------------

    def _ready(self, version: str) -> StagedVersion:
        v = self._versions.get(version)
        if v is None:
            raise StoreError(f"version {version!r} is not staged")
        if v.state != "ready":
            raise StoreError(f"version {version!r} is still staging")
        return v

    def descriptor(self, version: str, device: str | None = None) -> dict[str, Any]:
        with self._lock:
            v = self._ready(version)
            buffers = [b.ref() for b in v.buffers]
            if device is not None:
                uuid = self._resolve_device(device)
                buffers = [b for b in buffers if b.device_uuid == uuid]
                if not buffers:
                    raise StoreError(f"version {version!r} is not staged on device {device}")
            v.exported = True
            kind: Literal["cuda", "shm"] = "cuda" if self.backend.kind == "cuda" else "shm"
            desc = Descriptor(version, kind, v.size, v.slots, tuple(buffers), v.digest, self.socket_path)
            return desc.to_json()

    def _resolve_device(self, device: str) -> str:
        if device in self.backend.devices:
            return device
        if device in ("cpu", HOST_DEVICE) and self.backend.kind == "shm":
            return HOST_DEVICE
        idx = device.removeprefix("cuda:")
        if self.backend.kind == "cuda" and idx.isdigit():
            from daemon.transport.ipc_cuda import device_uuid

            return device_uuid(int(idx))
        raise StoreError(f"unknown device {device!r}; staged devices: {', '.join(self.backend.devices)}")

    def acquire(self, version: str, worker: str, pid: int | None = None) -> dict[str, Any]:
        if pid is not None and pid <= 0:
            raise StoreError(f"pid must be a positive process id, got {pid}")
        with self._lock:
            v = self._ready(version)
            h = v.holders.setdefault(worker, Holder(0, pid))
            h.count += 1
            h.pid = pid if pid is not None else h.pid
            v.last_used = time.time()
            return {"version": version, "holders": len(v.holders)}

    def release(self, version: str, worker: str) -> dict[str, Any]:
        with self._lock:
            v = self._versions.get(version)
            if v is None or worker not in v.holders:
                raise StoreError(f"worker {worker!r} does not hold version {version!r}")
            h = v.holders[worker]
            h.count -= 1
            if h.count <= 0:
                del v.holders[worker]
            v.last_used = time.time()
            return {"version": version, "holders": len(v.holders)}

    def drop(self, version: str) -> dict[str, Any]:
        with self._lock:
            v = self._ready(version)
            holders = v.live_holders()
            if holders:
                who = ", ".join(f"{w} ({h.count})" for w, h in sorted(holders.items()))
                raise StoreError(f"version {version!r} is in use by {who}; not freed")
            freed = self._free(v)
        log.info("dropped %s", version)
        return {"version": version, "freed": freed}

    def status(self) -> dict[str, Any]:
        with self._lock:
            versions = [
                {
                    "version": v.version,
                    "state": v.state,
                    "path": str(v.path),
                    "digest": v.digest,
                    "bytes": v.buffer_bytes,
                    "tensors": len(v.slots),
                    "holders": {w: h.count for w, h in v.live_holders().items()},
                    "exported": v.exported,
                    "staged_at": v.staged_at,
                    "last_used": v.last_used,
                }
                for v in sorted(self._versions.values(), key=lambda v: v.staged_at)
            ]
            return {
                "kind": self.backend.kind,
                "devices": list(self.backend.devices),
                "budget_bytes": self.budget_bytes,
                "max_versions": self.max_versions,
                "used_bytes": sum(v.buffer_bytes for v in self._versions.values()),
                "versions": versions,
            }

    def close(self) -> None:
        """Free every version (shutdown); holders no longer matter once the loader exits."""
        with self._lock:
            for v in list(self._versions.values()):
                self._free(v)
