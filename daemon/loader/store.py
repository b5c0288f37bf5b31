"""Staged versions held by the loader: one flat buffer per device, a budget, and who holds what.

Policy, "serving + last good + one incoming": at most `max_versions` (3) versions resident
and at most `budget_bytes` per device. Staging a new version first evicts the least recently
used versions that no worker holds; a version some worker holds (acquired and not released,
by a process that is still alive) is never freed, and if no room can be made the stage is
refused with the reason. Versions are immutable once staged: staging the same version again
from the same directory returns the existing one, from another directory is refused.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from daemon.bytepipe import BadUpdateRequest, Crcs, Expect, ensure_contained
from daemon.formats import tensor_table, weight_files
from daemon.handoff import (
    ALIGN,
    HOST_DEVICE,
    MAX_VERSION_CHARS,
    Descriptor,
    TensorSlot,
    align_up,
    layout_tensors,
)
from daemon.hashing import DEFAULT_HASH_ALG, HASH_ALGORITHMS, DigestMismatch, content_digest
from daemon.loader.backends import (
    HASH_FOR_VERIFY,
    PID_MAX,
    Backend,
    CudaBackend,
    ShmBackend,
    StageCheck,
    StagedBuffer,
    StoreError,
    _pid_alive,
)

log = logging.getLogger("hotswap.loader")

MAP_WAIT_S = 30.0  # a `purpose="map"` descriptor's wait for the buffers (a 16 GB cuMemAlloc: ~0.1 s)

__all__ = ["Backend", "CudaBackend", "LoaderStore", "ShmBackend", "StagedBuffer", "StoreError"]


# ---- the store ---------------------------------------------------------------------------


def _digest_of(expect: Expect) -> str | None:
    """The content digest of the reference files (every file, strong hashes), None if they have none."""
    for alg in HASH_ALGORITHMS:
        files = [(f.path, f.bytes, f.digests.get(alg)) for f in expect.files]
        if files and all(h for _p, _n, h in files):
            return content_digest([_RefFile(p, n, h or "") for p, n, h in files], alg)
    return None


@dataclass(frozen=True, slots=True)
class _RefFile:
    path: str
    bytes: int
    hash: str


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
    files: tuple[tuple[str, int, str, str], ...] = ()  # computed by the loader while staging
    checked: bool = False  # every file matched the reference the daemon gave
    verified: bool = True  # False: staged for the daemon's checks; exported only once `verified`
    crc32c: dict[str, str] = field(default_factory=dict)  # per file, when staged for verification
    # set once the buffers exist (or the stage failed): a `purpose="map"` descriptor waits for it
    allocated: threading.Event = field(default_factory=threading.Event)

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
        self.hash_threads = max(1, os.cpu_count() or 1)
        self._versions: dict[str, StagedVersion] = {}
        self._lock = threading.Lock()
        self._added = threading.Condition(self._lock)  # a version was registered (a map descriptor waits)

    # -- stage ---------------------------------------------------------------------------

    def stage(
        self,
        version: str,
        path: str,
        digest: str | None = None,
        files: list[Any] | None = None,
        verify_alg: str | None = None,
    ) -> dict[str, Any]:
        """Stage `path` as `version`. `files`: the registry's per-file digests ({path, bytes,
        digests}); the loader hashes every byte it stages and refuses on a mismatch. `digest` is
        kept only when every file matched them; the descriptor carries the loader's own digests.

        `verify_alg` (the daemon's verify stages here: one read for hashes and staging): no
        reference; the loader computes `verify_alg` and CRC32C of every file and answers them in
        `digests`; the version is held back (its descriptor only for `purpose="check"`) until
        `verified` confirms it, and the daemon drops it if a check fails."""
        if not version or len(version) > MAX_VERSION_CHARS or "\x00" in version:
            raise StoreError(f"bad version label {version!r}")
        if verify_alg is not None and (verify_alg not in HASH_FOR_VERIFY or files):
            raise StoreError(f"stage: verify_alg must be one of {list(HASH_FOR_VERIFY)}, without files")
        try:
            expect = Expect.from_json({"files": files or []})
        except BadUpdateRequest as exc:
            raise StoreError(f"stage: {exc}") from None
        directory = Path(path)
        with self._lock:
            existing = self._versions.get(version)
            if existing is not None:
                return self._existing(existing, directory)
        if not directory.is_dir():
            raise StoreError(f"{directory}: not a checkpoint directory")
        try:
            ensure_contained(directory, weight_files(directory))
        except DigestMismatch as exc:
            raise StoreError(str(exc)) from None
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
            self._added.notify_all()
        t0 = time.perf_counter()
        crcs = Crcs() if verify_alg is not None else None
        check = StageCheck(directory, expect, self.hash_threads, verify_alg or DEFAULT_HASH_ALG, crcs)
        entry.verified = verify_alg is None
        try:
            try:
                entry.buffers = self.backend.allocate(version, entry.buffer_bytes)
            finally:
                entry.allocated.set()
            self.backend.fill(entry.buffers, table, slots, check)
            entry.files, entry.checked = check.finish()
            if crcs is not None:
                entry.crc32c = {p: crcs.result(directory / p, n) for p, n, _a, _h in entry.files}
            if not (entry.checked and _digest_of(expect) == digest):
                entry.digest = None  # the client's claim is not repeated unless the bytes bore it out
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
        info = {**self._info(entry), "staged_now": True}
        if verify_alg is not None:
            info["digests"] = [{"path": p, "bytes": n, "crc32c": entry.crc32c[p], "hash_alg": a, "hash": h}
                               for p, n, a, h in entry.files]  # fmt: skip
        return info

    def verified(self, version: str, files: list[Any], digest: str | None = None) -> dict[str, Any]:
        """The daemon's checks passed: `files` (the registry's digests now, every file) must agree
        with what this loader computed while staging; then the version is exported like any
        other (checked). `digest` is kept only when the files bear it out, as for `stage`."""
        try:
            expect = Expect.from_json({"files": files})
        except BadUpdateRequest as exc:
            raise StoreError(f"verified: {exc}") from None
        with self._lock:
            v = self._ready(version)
            if v.verified:
                return {"version": version, "verified": True}
            own = {p: (n, a, h) for p, n, a, h in v.files}
            theirs = {f.path: (f.bytes, f.digests) for f in expect.files}
            for p, (n, a, h) in own.items():
                if p not in theirs or theirs[p][0] != n or theirs[p][1].get(a) != h:
                    raise StoreError(f"verified {version!r}: {p} does not match what was staged and hashed here")
            v.verified = v.checked = True
            v.digest = digest if digest is not None and _digest_of(expect) == digest else None
            return {"version": version, "verified": True}

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
            "checked": v.checked,
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

    def descriptor(self, version: str, device: str | None = None, purpose: str | None = None) -> dict[str, Any]:
        """`purpose="check"`: the daemon's checks read a version not yet `verified` (not exported).
        `purpose="map"`: the buffers of a version still staging, as soon as they are allocated
        (waits up to MAP_WAIT_S), with no file digests: the daemon's checks open them while the
        bytes arrive (a CUDA IPC open costs ~80-100 ms for 8B) and read them only after `stage`
        answered. Its bytes are as unverified as a check descriptor's; it exports nothing."""
        if purpose not in (None, "check", "map"):
            raise StoreError(f"descriptor: unknown purpose {purpose!r}")
        if purpose == "map":
            return self._map_descriptor(version, device)
        with self._lock:
            v = self._ready(version)
            if not v.verified and purpose != "check":
                raise StoreError(f"version {version!r} is staged but not verified yet; not exported")
            buffers = self._buffers_on(v, device)
            v.exported = v.exported or purpose is None
            return self._descriptor(v, buffers, v.digest, v.files, v.checked)

    def _map_descriptor(self, version: str, device: str | None) -> dict[str, Any]:
        # asked beside the stage request, which may not have registered the version yet
        deadline = time.monotonic() + MAP_WAIT_S
        with self._added:
            self._added.wait_for(lambda: version in self._versions, timeout=MAP_WAIT_S)
            v = self._versions.get(version)
        if v is None:
            raise StoreError(f"version {version!r} is not staged (waited {MAP_WAIT_S:g} s for its stage)")
        if not v.allocated.wait(max(0.0, deadline - time.monotonic())):
            raise StoreError(f"version {version!r}: its buffers were not allocated within {MAP_WAIT_S:g} s")
        with self._lock:
            if self._versions.get(version) is not v or not v.buffers:
                raise StoreError(f"version {version!r} is no longer staging (its stage failed or it was dropped)")
            return self._descriptor(v, self._buffers_on(v, device), None, (), False)  # nothing known of the bytes yet

    def _buffers_on(self, v: StagedVersion, device: str | None) -> list[Any]:
        """References to `v`'s buffers, only the one on `device` when named."""
        buffers = [b.ref() for b in v.buffers]
        if device is not None:
            uuid = self._resolve_device(device)
            buffers = [b for b in buffers if b.device_uuid == uuid]
            if not buffers:
                raise StoreError(f"version {v.version!r} is not staged on device {device}")
        return buffers

    def _descriptor(self, v: StagedVersion, buffers: list[Any], digest: str | None,
                    files: tuple[tuple[str, int, str, str], ...], checked: bool) -> dict[str, Any]:  # fmt: skip
        kind: Literal["cuda", "shm"] = "cuda" if self.backend.kind == "cuda" else "shm"
        desc = Descriptor(v.version, kind, v.size, v.slots, tuple(buffers), digest, self.socket_path, files, checked)
        return desc.to_json()

    def _resolve_device(self, device: str) -> str:
        if device in self.backend.devices:
            return device
        if device in ("cpu", HOST_DEVICE) and self.backend.kind == "shm":
            return HOST_DEVICE
        idx = device.removeprefix("cuda:")
        if self.backend.kind == "cuda" and idx.isdigit():
            from daemon.handoff import device_uuid

            return device_uuid(int(idx))
        raise StoreError(f"unknown device {device!r}; staged devices: {', '.join(self.backend.devices)}")

    def acquire(self, version: str, worker: str, pid: int | None = None) -> dict[str, Any]:
        if pid is not None and not 0 < pid <= PID_MAX:
            raise StoreError(f"pid must be a positive process id no larger than {PID_MAX}, got {pid}")
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
                    "verified": v.verified,
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
