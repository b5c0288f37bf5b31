"""The ipc transport's staging for the daemon's verify: the loader reads the bytes once, for both.

With transport = "ipc" the daemon's verify is given a `LoaderStager` (from `IpcSender.verify_stager`):
the crc32c pass asks it to stage the weights with no reference (`stage` with `verify_alg`); the
loader reads every file once into its GPU buffer (shared host memory without a GPU), hashing each
chunk (strong hash and CRC32C) from the buffer it copies from, and answers its digests; the check
compares them with the manifest. The finite scan and the forward canary then read the loader's
buffer through `LoaderStaged` (CUDA IPC handle / sealed segment, read-only use). The staging and its
outcome (export once `finish(ok=True)`, drop otherwise) belong to the transport: a check only reads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from daemon.bytepipe import StagedTensors
from daemon.common import get_logger
from daemon.formats import TensorLocation
from daemon.handoff import (
    BufferRef,
    Descriptor,
    ImportedBuffer,
    LoaderClient,
    LoaderError,
    ShmMapping,
    device_index,
    device_uuid,
    parse_descriptor,
)
from daemon.hashing import FileDigest
from daemon.manifest import ManifestFile

log = get_logger(__name__)

MAP_JOIN_S = 5.0  # the view's wait for the map-ahead's open: past it, the view opens the buffer itself


def _cuda_ref(desc: Descriptor, want_device: str) -> BufferRef:
    """The buffer on `want_device` when the loader staged one there, else its first."""
    want = torch.device(want_device)
    uuids = [b.device_uuid for b in desc.buffers]
    wanted = device_uuid(want.index or 0) if want.type == "cuda" else None
    ref = desc.buffer_for(wanted if wanted in uuids else uuids[0])
    assert ref.handle is not None
    return ref


class _Opened:
    """CUDA IPC mappings opened ahead of their bytes (`Premap`), by (version, handle): the first
    LoaderStaged of that version and buffer in this process takes the mapping instead of opening."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, bytes], ImportedBuffer] = {}

    def put(self, key: tuple[str, bytes], mapping: ImportedBuffer) -> None:
        with self._lock:
            old = self._held.pop(key, None)
            self._held[key] = mapping
        if old is not None:
            old.close()

    def take(self, key: tuple[str, bytes], nbytes: int) -> ImportedBuffer | None:
        with self._lock:
            mapping = self._held.pop(key, None)
        if mapping is not None and mapping.nbytes != nbytes:
            mapping.close()
            return None
        return mapping

    def discard(self, key: tuple[str, bytes], mapping: ImportedBuffer) -> None:
        """Close `mapping` if it is still held unclaimed (a claimed one belongs to its view)."""
        with self._lock:
            mine = self._held.get(key) is mapping
            if mine:
                del self._held[key]
        if mine:
            mapping.close()

    def held(self) -> int:
        with self._lock:
            return len(self._held)


OPENED_AHEAD = _Opened()


class Premap:
    """A loader buffer opened in this process while the loader still fills it (a `purpose="map"`
    descriptor), held in OPENED_AHEAD until this version's LoaderStaged takes it, or discarded.
    Only CUDA: a sealed segment maps in under a millisecond, and not before it is sealed.
    Pickled, it opens in the process that unpickles it (the check process: daemon.checks.isolation)."""

    def __init__(self, desc: Descriptor, want_device: str) -> None:
        self.desc, self.want_device = desc, want_device
        self._opened: tuple[tuple[str, bytes], ImportedBuffer] | None = None
        if desc.kind == "cuda":
            ref = _cuda_ref(desc, want_device)
            assert ref.handle is not None
            key = (desc.version, ref.handle)
            mapping = ImportedBuffer(ref.device_uuid, ref.handle, ref.buffer_bytes)
            OPENED_AHEAD.put(key, mapping)
            self._opened = key, mapping

    def __reduce__(self) -> tuple[Any, ...]:
        return (Premap, (self.desc, self.want_device))

    def discard(self) -> None:
        if self._opened is not None:
            OPENED_AHEAD.discard(*self._opened)
            self._opened = None


class LoaderStaged(StagedTensors):
    """Views of one version's tensors in the loader's buffer, opened in this process (or taken
    from a `Premap` of the same version and buffer)."""

    def __init__(self, desc: Descriptor, want_device: str) -> None:
        self.desc = desc
        self.slots = {t.name: t for t in desc.tensors}
        self._mapping: ImportedBuffer | ShmMapping | None
        self.opened_ahead = False  # taken from a Premap, opened while the loader read
        if desc.kind == "cuda":
            ref = _cuda_ref(desc, want_device)
            assert ref.handle is not None
            ahead = OPENED_AHEAD.take((desc.version, ref.handle), ref.buffer_bytes)
            self.opened_ahead = ahead is not None
            self._mapping = ahead or ImportedBuffer(ref.device_uuid, ref.handle, ref.buffer_bytes)
            self.device = f"cuda:{device_index(ref.device_uuid)}"
        else:
            ref = desc.buffers[0]
            assert ref.path is not None
            self._mapping = ShmMapping(ref.path, ref.buffer_bytes)
            self.device = "cpu"
        self._offset = ref.offset
        self._buffer: torch.Tensor | None = self._mapping.tensor()

    @property
    def nbytes(self) -> int:
        return self.desc.size

    @property
    def shareable(self) -> bool:
        return True  # the check process opens the loader's handle (or segment) itself

    @property
    def owned_elsewhere(self) -> bool:
        return True  # the loader frees its buffer when its own accounting says so, not on our close

    def __reduce__(self) -> tuple[Any, ...]:
        # crosses to the check process as the descriptor: it opens the loader's buffer read-only
        return (LoaderStaged, (self.desc, self.device))

    def raw_tensor(self, name: str, loc: TensorLocation, root: Path) -> torch.Tensor:
        slot = self.slots.get(name)
        if slot is None or slot.dtype != loc.entry.dtype or tuple(slot.shape) != tuple(loc.entry.shape):
            raise ValueError(f"tensor {name!r}: the loader staged {slot} for the header's {loc.entry}")
        if self._buffer is None:
            raise ValueError("the loader's staged copy was released")
        start = self._offset + slot.offset
        return self._buffer[start : start + slot.nbytes]

    def release(self) -> None:
        buffer, mapping = self._buffer, self._mapping
        self._buffer = self._mapping = None
        if mapping is None:
            return
        if buffer is not None and buffer.device.type == "cuda":
            # the loader owns the bytes and frees them on its own accounting: this process's
            # synchronize and unmap (~40 ms for 16 GB on an H100) need not hold up the update
            device, buffer = buffer.device, None
            threading.Thread(target=_close_after_sync, args=(device, mapping), name="ipc-view-close", daemon=True).start()
            return
        mapping.close()


def _close_after_sync(device: torch.device, mapping: ImportedBuffer | ShmMapping) -> None:
    try:
        torch.cuda.synchronize(device)  # no kernel may still read it
        mapping.close()
    except Exception as exc:  # noqa: BLE001  (a thread's error would only warn: log it, the mapping goes at exit)
        log.warning("closing_verify_view_failed", error=f"{type(exc).__name__}: {exc}")


class LoaderStager:
    """The crc32c pass's staging in the loader for one version (it matches daemon.checks.base.VerifyStager)."""

    holds_bytes = True  # a copy of the weights: checks.stage_device "off" turns it down

    def __init__(self, loader: LoaderClient, version: str, device: str,
                 on_verified: Callable[[str], None] | None = None,
                 workers: Callable[[str | None, str | None], None] | None = None) -> None:  # fmt: skip
        """`workers(version, loader socket)`: asks the host's workers to open the buffer too while
        the checks run (MapsAhead), `workers(None, None)` to let it go when the version fails."""
        self.loader = loader
        self.version = version
        self.device = device
        self.on_verified = on_verified
        self.workers = workers
        self.staged_here = False
        self.digests: dict[str, FileDigest] = {}
        self._ahead: MapAhead | None = None

    def stage(self, root: Path, rels: list[str], alg: str,
              on_mapped: Callable[[Premap | None], None] | None = None) -> tuple[list[FileDigest], StagedTensors] | None:  # fmt: skip
        """Digests of `rels` (the weight files) and the loader's copy; None when the loader cannot
        (not running, or it holds this version already: then verify reads the files itself).

        While the loader reads, this process opens the loader's buffer (`MapAhead`), and
        `on_mapped` is handed the `Premap` to open it elsewhere too (the check process); it is
        called with None at `finish`, when whatever was opened ahead and not used is let go."""
        self._ahead = ahead = MapAhead(self.loader, self.version, self.device, on_mapped, self.workers)
        ahead.start()
        try:
            got = self._stage(root, rels, alg, ahead)
        except BaseException:
            ahead.abandon()
            raise
        if got is None:
            ahead.abandon()
        return got

    def _stage(self, root: Path, rels: list[str], alg: str,
               ahead: MapAhead) -> tuple[list[FileDigest], StagedTensors] | None:  # fmt: skip
        try:
            info = self.loader.stage_for_verify(self.version, root, alg)
        except LoaderError as exc:
            log.warning("verify_staging_in_loader_failed", version=self.version, error=str(exc))
            return None
        if not info.get("staged_now"):
            ahead.abandon()  # it may have opened the earlier copy, dropped below
            try:
                held = {v["version"]: v for v in self.loader.status()["versions"]}
                if held.get(self.version, {}).get("verified") is not False:
                    return None  # staged and exported before (a re-verify): not confirmed by this pass
                self.loader.drop(self.version)  # held back by an earlier verify that never finished
                info = self.loader.stage_for_verify(self.version, root, alg)
            except LoaderError as exc:
                log.warning("verify_staging_in_loader_failed", version=self.version, error=str(exc))
                return None
            if not info.get("staged_now"):
                return None
        self.staged_here = True
        got = {d["path"]: FileDigest(d["bytes"], d["crc32c"], d["hash_alg"], d["hash"]) for d in info["digests"]}
        if sorted(got) != sorted(rels):
            raise ValueError(f"the loader staged {sorted(got)}, the checkpoint's weight files are {sorted(rels)}")
        ahead.join(MAP_JOIN_S)  # registered (or given up) before the view looks for it
        try:
            view = LoaderStaged(parse_descriptor(self.loader.descriptor(self.version, purpose="check")), self.device)
        except (LoaderError, RuntimeError, ValueError) as exc:  # cannot open it here: verify reads itself
            log.warning("verify_staging_view_failed", version=self.version, error=f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(LoaderError):
                self.loader.drop(self.version)
            self.staged_here = False
            return None
        self.digests = got
        return [got[r] for r in rels], view

    def finish(self, ok: bool, files: list[ManifestFile], digest: str | None) -> None:
        """Checks over: export it (with every file's digests as verify recorded them) or drop it."""
        if self._ahead is not None:
            self._ahead.abandon(workers_keep=ok and self.staged_here)  # their prepare takes it next
        if not self.staged_here:
            return
        try:
            if ok:
                self.loader.verified(self.version, [_expected(f) for f in files], digest)
                if self.on_verified is not None:
                    self.on_verified(self.version)
            else:
                self.loader.drop(self.version)
        except LoaderError as exc:
            log.warning("verify_staging_finish_failed", version=self.version, ok=ok, error=str(exc))
            if ok:  # never leave it held back: the rollout's own stage then starts afresh
                with contextlib.suppress(LoaderError):
                    self.loader.drop(self.version)


class MapAhead(threading.Thread):
    """Opens a version's loader buffer while the loader still fills it: asks for its `purpose="map"`
    descriptor (answered once the buffer is allocated), opens it here (`Premap`), and hands the
    Premap to `on_mapped`. `abandon()` (the stage failed, or the checks are over) lets go of what
    it opened and no view took, now or when the thread gets there; then `on_mapped(None)`."""

    def __init__(self, loader: LoaderClient, version: str, device: str,
                 on_mapped: Callable[[Premap | None], None] | None,
                 workers: Callable[[str | None, str | None], None] | None = None) -> None:  # fmt: skip
        super().__init__(name=f"map-ahead-{version}", daemon=True)
        self.loader, self.version, self.device, self.on_mapped = loader, version, device, on_mapped
        self.workers = workers
        self._lock = threading.Lock()
        self._abandoned = False
        self._premap: Premap | None = None
        self._handed = False  # on_mapped was given a Premap: it is told None at the end
        self._told_workers = False

    def run(self) -> None:
        try:
            desc = parse_descriptor(self.loader.descriptor(self.version, purpose="map"))
            if desc.kind == "cuda" and self.workers is not None:  # they open beside this process
                with self._lock:
                    self._told_workers = not self._abandoned
                if self._told_workers:
                    self.workers(self.version, self.loader.socket_path)
            premap = Premap(desc, self.device)
        except Exception as exc:  # noqa: BLE001  (only a head start lost: the view opens as before)
            log.info("map_ahead_skipped", version=self.version, error=f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            if self._abandoned:
                premap.discard()
                return
            self._premap = premap
            if self.on_mapped is not None and premap.desc.kind == "cuda":
                self._handed = True
                self._call(premap)

    def abandon(self, workers_keep: bool = False) -> None:
        """`workers_keep`: the version passed: the workers' prepare takes what they opened."""
        with self._lock:
            if self._abandoned:
                return
            self._abandoned = True
            premap, handed = self._premap, self._handed
            self._premap = None
            if premap is not None:
                premap.discard()
            if handed:
                self._call(None)
            told = self._told_workers
        if told and not workers_keep and self.workers is not None:
            try:
                self.workers(None, None)
            except Exception as exc:  # noqa: BLE001  (each worker lets it go on its own after a while)
                log.warning("map_ahead_let_go_failed", version=self.version, error=f"{type(exc).__name__}: {exc}")

    def _call(self, premap: Premap | None) -> None:
        assert self.on_mapped is not None
        try:
            self.on_mapped(premap)
        except Exception as exc:  # noqa: BLE001  (the other process opens at its check, as before)
            log.warning("map_ahead_handoff_failed", version=self.version, error=f"{type(exc).__name__}: {exc}")


def _expected(f: ManifestFile) -> dict[str, Any]:
    digests = {k: v for k, v in ((f.hash_alg or "", f.hash), ("crc32c", f.crc32c)) if k and v}
    return {"path": f.path, "bytes": f.bytes, "digests": digests}
