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


class LoaderStaged(StagedTensors):
    """Views of one version's tensors in the loader's buffer, opened in this process."""

    def __init__(self, desc: Descriptor, want_device: str) -> None:
        self.desc = desc
        self.slots = {t.name: t for t in desc.tensors}
        self._mapping: ImportedBuffer | ShmMapping | None
        if desc.kind == "cuda":
            want = torch.device(want_device)
            uuids = [b.device_uuid for b in desc.buffers]
            wanted = device_uuid(want.index or 0) if want.type == "cuda" else None
            ref = desc.buffer_for(wanted if wanted in uuids else uuids[0])
            assert ref.handle is not None
            self._mapping = ImportedBuffer(ref.device_uuid, ref.handle, ref.buffer_bytes)
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

    def __init__(self, loader: LoaderClient, version: str, device: str,
                 on_verified: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.loader = loader
        self.version = version
        self.device = device
        self.on_verified = on_verified
        self.staged_here = False
        self.digests: dict[str, FileDigest] = {}

    def stage(self, root: Path, rels: list[str], alg: str) -> tuple[list[FileDigest], StagedTensors] | None:
        """Digests of `rels` (the weight files) and the loader's copy; None when the loader cannot
        (not running, or it holds this version already: then verify reads the files itself)."""
        try:
            info = self.loader.stage_for_verify(self.version, root, alg)
        except LoaderError as exc:
            log.warning("verify_staging_in_loader_failed", version=self.version, error=str(exc))
            return None
        if not info.get("staged_now"):
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


def _expected(f: ManifestFile) -> dict[str, Any]:
    digests = {k: v for k, v in ((f.hash_alg or "", f.hash), ("crc32c", f.crc32c)) if k and v}
    return {"path": f.path, "bytes": f.bytes, "digests": digests}
