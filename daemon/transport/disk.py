"""Disk transport: overwrite live parameters in place from a safetensors checkpoint directory.

Daemon side (`DiskSender`): the request is the verified checkpoint's local directory.
Worker side (`open_update` -> `DiskTransport`), the rest of this module:

Every shard header is parsed (strictly) before anything is written, so `table()` gives the whole
tensor table for `check_table`. `write_into` then writes into the parameters' existing storage;
no tensor is reallocated, so `data_ptr()`s, CUDA graphs and the caching allocator stay valid.

Two paths, picked per parameter device, both in `daemon.transport.disk_read` (the reader
threads, the pinned pool, the side streams): CUDA parameters are read in chunks into pinned host
buffers and copied to the GPU on the readers' streams; CPU parameters are read straight into
their memory. `write` here picks the path, plans the chunks and sets up the check.

Check while loading: with `expect.files` (the registry's verified per-file digests, which the
daemon sends with every update) every byte read is hashed from the very buffer it was read into
(`daemon.transport.check`: each file hashed in file order, header included, files in parallel);
the write returns only once every file was hashed and compared. A file that does not
match is a TransportError after the write, nothing is committed and the worker restores the
previous weights. Weight files that leave the directory (symlinks to
/etc/shadow) are refused before a byte of them is read.

Errors name the file, the tensor and the offset. A failure part way through leaves the
parameters partly written: the caller (the worker) restores the previous weights.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.formats import MANIFEST_NAME, TensorLocation, tensor_table, weight_files
from daemon.hashing import FileDigest
from daemon.manifest import load_manifest
from daemon.transport.base import (
    BadUpdateRequest,
    DaemonTransportFactory,
    Expect,
    Outgoing,
    Prepared,
    SenderOptions,
    SourceChanged,
    StageError,
    TensorSpec,
    TransportError,
    UpdateRequest,
    WorkersAhead,
    WorkerTransportFactory,
)
from daemon.transport.check import (
    DigestMismatch,
    LoadCheck,
    ensure_contained,
    files_problem,
    reference_for,
    wants_check,
)
from daemon.transport.disk_read import (
    DEFAULT_CHECK_BUFFERS,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_READERS,
    WriteStats,
    byte_view,
    interleave,
    plan_chunks,
    read_direct,
    read_staged,
)

if TYPE_CHECKING:
    import torch


class DiskSender:
    """Daemon side: workers read the verified checkpoint's directory themselves."""

    name = "disk"

    def __init__(self, options: SenderOptions) -> None:
        self.options = options

    def prepare(self, item: Outgoing) -> Prepared:
        problem = files_problem(item.local_path, item.expect)  # never send workers to missing files
        if problem is not None:
            raise StageError(f"{item.version}: {problem}")
        return Prepared(UpdateRequest(item.version, "disk", {"path": item.local_path}, "copy", item.expect))

    def verify_stager(self, version: str, device: str, workers: WorkersAhead | None = None) -> ReadAheadAsk | None:
        """For the daemon's verify: asks the host's workers to read `version` while it is verified
        (daemon.worker.read_ahead); the crc32c pass still reads and hashes it here."""
        return ReadAheadAsk(version, workers.read) if workers is not None and workers.read is not None else None

    def retain(self, versions: set[str]) -> None:
        return None  # nothing held: the directories are the registry's

    def close(self) -> None:
        return None


class ReadAheadAsk:
    """A VerifyStager (daemon.checks) that stages nothing: when the crc32c pass starts, with the
    file list and the strong hash known, it asks the workers to read the version; a version that
    fails its checks has them let go. The workers' reads are vouched for by the verified digests
    at their prepare, never by this."""

    holds_bytes = False  # asked with checks.stage_device "off" too: the workers read, not the checks

    def __init__(self, version: str, read: Callable[[str | None, str | None, str | None, int], None]) -> None:
        self.version, self.read = version, read
        self.asked = False

    def stage(self, root: Path, rels: list[str], alg: str, on_mapped: Any = None) -> None:
        if alg != "crc32c":  # a read ahead is vouched for by a strong hash only
            try:
                nbytes = sum((root / r).stat().st_size for r in rels)  # the workers keep room for copies of it
            except OSError:
                return  # a file gone: the crc32c pass itself says so; nobody reads ahead
            self.read(self.version, str(root), alg, nbytes)
            self.asked = True

    def finish(self, ok: bool, files: list[Any], digest: str | None) -> None:
        if self.asked and not ok:
            self.read(None, None, None, 0)


def open_update(request: UpdateRequest, store: object) -> DiskTransport:
    """Worker side, from an update request: `path` names the checkpoint directory."""
    path = request.source.get("path")
    if not isinstance(path, str) or not path:
        raise BadUpdateRequest("disk transport needs 'path' (a checkpoint directory)")
    tr = DiskTransport(path, expect=request.expect)
    tr.stage_ahead = getattr(store, "stage_disk", "auto")
    tr.flat = getattr(store, "flat", None)
    return tr


class DiskTransport:
    """A `WeightTransport` over a local checkpoint directory in Hugging Face safetensors layout."""

    name = "disk"

    def __init__(
        self,
        directory: str | Path,
        *,
        readers: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        staged: bool | None = None,
        expect: Expect | None = None,
        check: bool | None = None,
        compute_alg: str | None = None,
    ) -> None:
        """`staged`: None picks the pinned-pool path for CUDA parameters and direct reads for CPU
        ones; True sends CPU parameters through the pool too (exercises the chunk logic in CI).
        `expect`: the registry's per-file digests; every byte read is hashed and compared with
        them (check while loading) unless `check` is False. `check` True without digests refuses.
        `compute_alg`: a read ahead of verification (daemon.worker.read_ahead): no digests yet,
        every file read is hashed with this algorithm and kept in `computed` for `vouch`."""
        self.directory = Path(directory)
        self.expect = expect or Expect()
        self.compute_alg = compute_alg
        self.check = compute_alg is not None or (wants_check(self.expect) if check is None else check)
        if self.check and compute_alg is None and not wants_check(self.expect):
            raise BadUpdateRequest("check while loading needs expect.files (the verified per-file digests)")
        self.checked: dict[str, Any] = {}
        self.computed: dict[str, FileDigest] = {}  # with compute_alg: what each file read hashed to
        self.staged = staged
        self.readers = max(1, readers or min(DEFAULT_READERS, os.cpu_count() or 1))
        self.chunk_bytes = chunk_bytes
        self._locations: dict[str, TensorLocation] | None = None
        self.last_stats: WriteStats | None = None
        self.check_buffers = DEFAULT_CHECK_BUFFERS  # pinned buffers per reader while checking
        self.hash_threads = os.cpu_count() or 1  # BLAKE3 threads per file being hashed
        # `stage`: "auto" reads ahead into a device buffer for CUDA parameters, "on" for any
        # (host memory on the CPU: tests), "off" never; `flat`: the worker's flat weight buffer
        self.stage_ahead = "auto"
        self.flat: torch.Tensor | None = None
        self.ahead: Any = None  # a daemon.transport.ahead.Ahead (imported with torch, worker side only)
        self.ahead_note: str | None = None  # why a stage() read nothing ahead
        self.reserve_bytes = 0  # what the device must keep free beside the buffer (a read-ahead's ask)
        self.ahead_seconds = 0.0

    # -- WeightTransport -------------------------------------------------------------------
    def table(self) -> dict[str, TensorSpec]:
        """Parse every shard header (strict) and return the full tensor table."""
        if not self.directory.is_dir():
            raise TransportError(f"{self.directory}: checkpoint directory does not exist")
        if self._locations is None:
            try:
                ensure_contained(self.directory, weight_files(self.directory))
            except DigestMismatch as exc:
                raise TransportError(str(exc)) from None
            self._locations, _ = tensor_table(self.directory)
        return {
            n: TensorSpec(n, loc.entry.dtype, loc.entry.shape, loc.entry.nbytes)
            for n, loc in self._locations.items()
        }

    def stage(self, params: dict[str, torch.Tensor]) -> None:
        """Before the pause: read (and check) the whole version into an `Ahead` buffer, so that
        `write_into` is a device copy of verified bytes. Reads nothing when staging is off, the
        parameters are on the CPU (unless "on") or the device has no room (`ahead_note` says);
        raises TransportError when the bytes do not match the registry's (nothing kept)."""
        from daemon.transport.ahead import Ahead, layout_like, room_for  # torch: never in the daemon

        if self.ahead is not None or self.stage_ahead == "off" or not params:
            return
        device = next(iter(params.values())).device
        if device.type != "cuda" and self.stage_ahead != "on":
            return
        need = layout_like(params, self.flat)[1]
        self.ahead_note = room_for(device, need + self.reserve_bytes)
        if self.ahead_note is not None:
            return
        ahead = Ahead(params, self.flat)
        try:
            self.ahead_seconds = self.write(ahead.views()).seconds
        except BaseException:
            ahead.free()
            raise
        self.ahead = ahead

    def write_into(self, params: dict[str, torch.Tensor]) -> None:
        if self.ahead is None:
            self.last_stats = self.write(params)
            return
        t0 = time.perf_counter()
        copies = int(self.ahead.copy_into(params, self.flat))
        self.last_stats = WriteStats(bytes=int(self.ahead.nbytes), tensors=len(params), chunks=copies,
                                     seconds=time.perf_counter() - t0, path="ahead")  # fmt: skip

    def vouch(self, expect: Expect) -> str | None:
        """After a read ahead (`compute_alg`): None when what it read is exactly what `expect` (the
        registry's verified digests) names: every file read listed and equal in size and strong
        digest, every listed weight file read; else why not. Then `expect` is this transport's."""
        if self.compute_alg is None or not self.computed:
            return "nothing was read ahead with digests"
        listed = {f.path: f for f in expect.files}
        for rel, got in sorted(self.computed.items()):
            f = listed.get(rel)
            ref = reference_for(f) if f is not None else None
            if ref is None or not ref.strong:
                return f"{rel}: the registry has no verified strong digest for this file"
            if ref.alg != got.hash_alg:
                return f"{rel}: read ahead with {got.hash_alg}, verified with {ref.alg}"
            if got.bytes != ref.bytes or got.hash != ref.value:
                return f"{rel}: the bytes read ahead are not the verified ones (changed since they were read)"
        unread = sorted(p for p in listed if p.endswith(".safetensors") and p not in self.computed)
        if unread:
            return f"{unread[0]}: verified weight file was not read ahead"
        self.expect = expect
        self.checked = {**self.checked, "check_alg": self.compute_alg, "checked_files": len(self.computed),
                        "check_weak": False, "read_ahead_of_verify": True}  # fmt: skip
        return None

    def source_digest(self) -> str | None:
        """The checkpoint's manifest digest, or None when it has no manifest."""
        if not (self.directory / MANIFEST_NAME).exists():
            return None
        return load_manifest(self.directory).digest

    def stats(self) -> dict[str, Any]:
        st = self.last_stats
        out: dict[str, Any] = {} if st is None else {"read_path": st.path, **self.checked}
        if self.ahead is not None:
            out["read_ahead_s"] = round(self.ahead_seconds, 4)
        elif self.ahead_note:
            out["read_ahead_skipped"] = self.ahead_note
        return out

    def close(self) -> None:
        self._locations = None
        self.flat = None  # the worker's buffer: a closed transport must not keep it alive (swap mode frees it)
        if self.ahead is not None:
            ahead, self.ahead = self.ahead, None
            ahead.free()

    # -- details ----------------------------------------------------------------------------
    def manifest_version(self) -> str | None:
        if not (self.directory / MANIFEST_NAME).exists():
            return None
        return load_manifest(self.directory).version

    def write(self, params: dict[str, torch.Tensor]) -> WriteStats:
        """Write every tensor of the table into `params` (the caller checked the table first)."""
        if self._locations is None:
            self.table()
        assert self._locations is not None
        missing = sorted(set(self._locations) - set(params))
        if missing:
            raise TransportError(f"no live parameter for tensor {missing[0]!r}")
        # check every destination before the first byte is written
        views: dict[str, torch.Tensor] = {}
        for name in self._locations:
            try:
                views[name] = byte_view(params[name])
            except TransportError as exc:
                raise TransportError(f"tensor {name!r}: {exc}") from None
        t0 = time.perf_counter()
        cuda = {n for n, v in views.items() if v.device.type == "cuda"}
        other = {n for n, v in views.items() if v.device.type == "cpu"}
        odd = set(views) - cuda - other
        if self.staged:
            cuda, other = cuda | other, set()
        elif self.staged is False:
            other, cuda = cuda | other, set()
        if odd:
            name = sorted(odd)[0]
            raise TransportError(f"tensor {name!r}: unsupported device {views[name].device}")
        stats = WriteStats(readers=self.readers)
        staged_locs = [self._locations[n] for n in sorted(cuda)]
        direct_locs = [self._locations[n] for n in sorted(other)]
        chunks = plan_chunks(staged_locs, self.chunk_bytes) if staged_locs else []
        check: LoadCheck | None = None
        self.checked = {}
        if self.check:
            ranges: dict[Path, list[tuple[int, int]]] = {}
            for c in chunks:
                ranges.setdefault(c.file, []).append((c.offset, c.nbytes))
            for loc in direct_locs:
                ranges.setdefault(loc.file, []).append((loc.entry.start, loc.entry.nbytes))
            try:
                check = LoadCheck(self.directory, self.expect, ranges, threads=self.hash_threads,
                                  compute_alg=self.compute_alg)  # fmt: skip
            except DigestMismatch as exc:
                raise SourceChanged(f"check while loading: {exc}") from None
            except OSError as exc:
                raise TransportError(f"check while loading: {exc}") from None
            chunks = interleave(chunks)  # the files hash in parallel, each in its own order
        try:
            if chunks:
                read_staged(chunks, views, stats, check, readers=self.readers, check_buffers=self.check_buffers,
                            chunk_bytes=self.chunk_bytes)  # fmt: skip
            if direct_locs:
                read_direct(direct_locs, views, stats, check, readers=self.readers)
            if check is not None:
                try:
                    self.checked = check.finish()
                    self.computed = dict(check.digests) if self.compute_alg is not None else {}
                except DigestMismatch as exc:
                    raise SourceChanged(f"check while loading: {exc}; nothing committed") from None
                except OSError as exc:
                    raise TransportError(f"check while loading: {exc}; nothing committed") from None
        finally:
            if check is not None:
                check.close()
        stats.tensors = len(views)
        stats.seconds = time.perf_counter() - t0
        stats.path = "staged" if cuda and not other else "direct" if other and not cuda else "mixed"
        return stats


# What daemon.transport.TRANSPORTS["disk"] names; mypy checks them against the protocols.
_SIDES: tuple[DaemonTransportFactory, WorkerTransportFactory] = (DiskSender, open_update)
