"""The update path: request -> transport -> table check -> in-place write -> caches dropped -> version set.

Transports are built by name through `daemon.transport.worker_transport` (the registry); this
module never asks which one it holds. Optional capabilities are asked with `isinstance`:
`OpensBeforePause` (opened before the write phase) and `SwapCapable` (mode "swap": the store
points the parameters at the transport's leased tensors; a transport without it refuses "swap").

Order of an update, all before any parameter changes except the last step:
1. request parsed (version, transport, mode, expect);
2. transport built and opened, its whole tensor table read (`table()`: headers / descriptor only);
3. `check_table` against the live parameters (names, shapes, dtypes, byte counts);
4. expect.tensors against the table, expect.digest against the source's digest (manifest);
   in swap mode, the lease of validated tensors is taken here; in copy mode a transport that
   can (`PlansCopies`: ipc) plans its copy and checksums its source here;
5. under the store lock (the scheduler is parked between steps): write_into(params) (ipc: the
   copy, then its checksum against the source's), or the swap; then every cache is invalidated
   and the version committed.
Steps 2-4 may run before the pause: `open_and_validate` (the controller's `prepare`, called by
the daemon while the worker still serves) returns an `Opened` that `apply_update(prepared=...)`
then uses, so only step 5 runs inside the pause. Whatever an update opened is let go through
`store.release` (after resume, when the store defers releases).

If step 5 fails, the previous weights are put back (the current record's `restore`, else a
fresh transport for the current record's request) before the caller hears about it; if that
fails too the store is marked unhealthy and the engine fails its requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from daemon.formats import HeaderError, LayoutError
from daemon.handoff import MAX_VERSION_CHARS
from daemon.transport import (
    TRANSPORTS,
    BadUpdateRequest,
    OpensBeforePause,
    PlansCopies,
    SourceChanged,
    SwapCapable,
    SwapLease,
    TableMismatch,
    TransportError,
    UpdateRequest,
    WorkerTransport,
    check_table,
    worker_transport,
)
from daemon.worker.store import VersionRecord, WeightStore

STRONG_ALGS = ("blake3", "sha256")  # what a read ahead of verification may hash with (vouched for by it)

log = logging.getLogger("hotswap.worker.updates")

OpenTransport = Callable[[UpdateRequest, WeightStore], WorkerTransport]
BeforeWrite = Callable[[UpdateRequest], None]


class UpdateError(Exception):
    """An update that did not happen. `status` is the HTTP status the worker answers with."""

    status = 500

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.detail = detail


class BadRequest(UpdateError):
    status = 422


class Refused(UpdateError):
    """Validation failed before any parameter changed."""

    status = 409


class SourceRefused(Refused):
    """The source's bytes did not match their verified digests while they were written, and the
    previous weights are back whole (re-read against their own digests, or a zero-copy restore):
    the worker holds what it served, so this is a refusal of the data, not a failure of the
    worker (the daemon resumes it where it was instead of marking it UNHEALTHY)."""


class WriteFailed(UpdateError):
    """The write failed; the previous weights were restored (detail["restored"] says whether)."""

    status = 500


def parse_request(raw: Any) -> UpdateRequest:
    """Step 1: the body of `POST /admin/update` as an `UpdateRequest`; BadRequest when it is not one."""
    try:
        request = UpdateRequest.from_json(raw)
    except BadUpdateRequest as exc:
        raise BadRequest(str(exc)) from None
    if request.transport not in TRANSPORTS:
        raise BadRequest(f"unknown transport {request.transport!r}; this worker has {sorted(TRANSPORTS)}")
    return request


def parse_read_ahead(raw: Any) -> tuple[str | None, str | None, str | None, int]:
    """The body of `POST /admin/read_ahead`: {"version": str | null, "path": absolute checkpoint
    directory, "alg": the strong hash its files are verified with, "reserve": bytes the device must
    keep free beside the buffer (optional, default 0)}."""
    if not isinstance(raw, dict) or set(raw) - {"version", "path", "alg", "reserve"}:
        raise BadRequest("read_ahead takes {'version': str or null, 'path': a checkpoint directory, "
                         "'alg': blake3|sha256, 'reserve': bytes}")  # fmt: skip
    version, path, alg, reserve = raw.get("version"), raw.get("path"), raw.get("alg"), raw.get("reserve", 0)
    if not isinstance(reserve, int) or isinstance(reserve, bool) or not 0 <= reserve < 1 << 60:
        raise BadRequest("'reserve' must be a whole number of bytes, 0 or more")
    if version is None:
        return None, None, None, 0
    if not isinstance(version, str) or not 0 < len(version) <= MAX_VERSION_CHARS or "\x00" in version:
        raise BadRequest(f"'version' must be a version label of 1 to {MAX_VERSION_CHARS} characters")
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 4096 or "\x00" in path:
        raise BadRequest("'path' must be the absolute path of the checkpoint directory")
    if alg not in STRONG_ALGS:
        raise BadRequest(f"'alg' must be one of {', '.join(STRONG_ALGS)} (a strong hash: the read is vouched for by it)")
    return version, path, alg, reserve


def parse_map_ahead(raw: Any) -> tuple[str | None, str | None]:
    """The body of `POST /admin/map_ahead`: {"version": str | null, "loader": absolute socket path}."""
    if not isinstance(raw, dict) or set(raw) - {"version", "loader"}:
        raise BadRequest("map_ahead takes {'version': str or null, 'loader': the loader's socket path}")
    version, loader = raw.get("version"), raw.get("loader")
    if version is None:
        return None, None
    if not isinstance(version, str) or not 0 < len(version) <= MAX_VERSION_CHARS or "\x00" in version:
        raise BadRequest(f"'version' must be a version label of 1 to {MAX_VERSION_CHARS} characters")
    if not isinstance(loader, str) or not loader.startswith("/") or len(loader) > 4096 or "\x00" in loader:
        raise BadRequest("'loader' must be the absolute path of the loader's socket")
    return version, loader


@dataclass(slots=True)
class Opened:
    """A transport whose table was read and checked, what its source says its digest is, and in
    swap mode the lease of tensors to point at."""

    transport: WorkerTransport
    digest: str | None
    lease: SwapLease | None = None
    open_ms: float = 0.0  # how long steps 2-4 took

    def close(self, store: WeightStore) -> None:
        """Let go of an `Opened` that will not be used (through the store: after resume)."""
        if self.lease is not None:
            lease, self.lease = self.lease, None
            store.release(lease.release)
        store.release(self.transport.close)


def open_and_validate(
    request: UpdateRequest, store: WeightStore, open_transport: OpenTransport = worker_transport
) -> Opened:
    """Steps 2-4. Nothing is written; on refusal everything opened is closed again."""
    t0 = time.perf_counter()
    try:
        transport = open_transport(request, store)
    except UpdateError:
        raise
    except BadUpdateRequest as exc:
        raise BadRequest(str(exc)) from None
    except (HeaderError, LayoutError, TransportError, OSError, ValueError) as exc:
        raise BadRequest(f"cannot read the new weights: {exc}") from None
    try:
        if request.mode == "swap" and not isinstance(transport, SwapCapable):
            raise BadRequest(f"mode 'swap' is not supported for transport {request.transport!r}")
        try:
            if isinstance(transport, OpensBeforePause):
                transport.open()
            table = transport.table()
        except (HeaderError, LayoutError, TransportError, OSError, ValueError) as exc:
            raise BadRequest(f"cannot read the new weights: {exc}") from None
        try:
            check_table(table, store.params)
        except TableMismatch as exc:
            raise Refused(f"tensor table does not match the served model (needs a restart rollout): {exc}") from None
        expect = request.expect
        if expect.tensors is not None and expect.tensors != len(table):
            raise Refused(f"expected {expect.tensors} tensors, the source has {len(table)}")
        try:
            digest = transport.source_digest()
        except Exception as exc:
            raise BadRequest(f"cannot read the source's manifest: {exc}") from None
        if expect.digest is not None and digest is not None and digest != expect.digest:
            raise Refused(f"expected digest {expect.digest}, the source's manifest says {digest}")
        lease = None
        if request.mode == "copy" and isinstance(transport, PlansCopies):
            try:  # the copy plan and the source's checksum, before the pause (issue 41)
                transport.prepare_copy(store.params)
            except (TransportError, ValueError) as exc:
                raise BadRequest(f"cannot read the new weights: {exc}") from None
        if request.mode == "swap":
            assert isinstance(transport, SwapCapable)
            try:
                lease = transport.lease(store.params)
            except (TransportError, ValueError) as exc:
                raise BadRequest(f"cannot read the new weights: {exc}") from None
    except BaseException:
        transport.close()
        raise
    return Opened(transport, digest, lease, (time.perf_counter() - t0) * 1e3)


def apply_update(
    store: WeightStore,
    request: UpdateRequest,
    *,
    open_transport: OpenTransport = worker_transport,
    before_write: Sequence[BeforeWrite] = (),
    prepared: Opened | None = None,
) -> dict[str, Any]:
    """Validate, then write under the store lock. Raises UpdateError subclasses.

    `prepared`: `open_and_validate` of this very request, done before the pause (it is used and
    let go here). `before_write` run between validation and the write phase (a test seam: the
    failure tests damage the source there); production passes none.
    """
    t0 = time.perf_counter()
    opened = prepared if prepared is not None else open_and_validate(request, store, open_transport)
    transport, digest = opened.transport, opened.digest
    validated_ms = (time.perf_counter() - t0) * 1e3
    path = request.source.get("path")
    record = VersionRecord(
        version=request.version,
        digest=digest if digest is not None else request.expect.digest,
        transport=request.transport,
        path=path if isinstance(path, str) else None,
        mode=request.mode,
        # with its expect: a restore or rollback re-reads it checked against the same digests
        request=request.to_json(),
    )
    try:
        for hook in before_write:
            hook(request)
        with store.lock:
            previous = store.current.version
            t1 = time.perf_counter()
            try:
                if opened.lease is not None:
                    lease, opened.lease = opened.lease, None
                    store.swap_in(lease, record)
                else:
                    store.prepare_for_copy()  # a swap may have left params on a leased buffer
                    transport.write_into(store.params)
                if digest is None:  # a transport hashing what it received (broadcast) knows it only now
                    record.digest = transport.source_digest() or record.digest
            except Exception as exc:
                log.error("write of %s failed: %s; restoring %s", request.version, exc, previous)
                restored = restore_current(store)
                if restored and isinstance(exc, SourceChanged):
                    raise SourceRefused(f"version {request.version} refused: {exc}; restored {previous}",
                                        restored=True) from None  # fmt: skip
                raise WriteFailed(
                    f"writing version {request.version} failed: {exc}; "
                    + (f"restored {previous}" if restored else f"restoring {previous} failed too: {store.unhealthy}"),
                    restored=restored,
                ) from None
            write_ms = (time.perf_counter() - t1) * 1e3
            store.invalidate_caches()
            store.commit(record)
    finally:
        opened.close(store)  # a lease taken and never used, and the transport: after resume
    result: dict[str, Any] = {
        "version": request.version,
        "previous_version": previous,
        "duration_ms": (time.perf_counter() - t0) * 1e3,
        "validate_ms": validated_ms,
        "write_ms": write_ms,
        "prepared": prepared is not None,  # opened and validated before the pause
        "open_ms": opened.open_ms,
        "transport": request.transport,
        "mode": request.mode,
        "digest": record.digest,
        "tensors": store.tensors,
        "bytes": store.bytes,
        **transport.stats(),
    }
    # checked: every byte read was hashed and matched the registry's per-file digests
    result["digest_checked"] = bool(result.get("checked_files"))
    store.last_update = result
    return result


def restore_current(store: WeightStore) -> bool:
    """Put the current record's weights back after a failed write (caller holds the lock).

    Uses the record's zero-copy `restore` when it has one, else re-reads its source through
    the transport registry. On failure marks the store unhealthy and returns False.
    """
    rec = store.current
    try:
        _load_record(store, rec)
    except Exception as exc:
        store.unhealthy = f"version {rec.version} could not be restored: {exc}"
        log.error("restore failed: %s", store.unhealthy)
        return False
    store.unhealthy = None
    store.invalidate_caches()
    return True


def _open_record(store: WeightStore, rec: VersionRecord) -> WorkerTransport | None:
    """A transport for `rec` with its table read and checked (nothing written); None when the
    record has a zero-copy `restore` instead."""
    if rec.restore is not None:
        return None
    if rec.transport not in TRANSPORTS:
        raise TransportError(f"transport {rec.transport!r} is not available to reload {rec.version}")
    request = UpdateRequest.from_json({**rec.request, "version": rec.version, "transport": rec.transport, "mode": "copy"})
    transport = worker_transport(request, store)
    try:
        if isinstance(transport, OpensBeforePause):
            transport.open()
        check_table(transport.table(), store.params)
    except BaseException:
        transport.close()
        raise
    return transport


def _write_record(rec: VersionRecord, transport: WorkerTransport | None, store: WeightStore) -> None:
    if transport is None:
        assert rec.restore is not None
        rec.restore()
        return
    try:
        store.prepare_for_copy()
        transport.write_into(store.params)
    finally:
        store.release(transport.close)


def _load_record(store: WeightStore, rec: VersionRecord) -> None:
    _write_record(rec, _open_record(store, rec), store)


def rollback(store: WeightStore) -> dict[str, Any]:
    """Back to the retained previous version; from an unhealthy store: back to the last good one."""
    t0 = time.perf_counter()
    with store.lock:
        if store.unhealthy:
            if not restore_current(store):
                raise WriteFailed(f"restore failed: {store.unhealthy}", restored=False)
            return {"version": store.current.version, "rolled_back_from": None,
                    "duration_ms": (time.perf_counter() - t0) * 1e3, "recovered": True}  # fmt: skip
        prev = store.previous
        if prev is None:
            raise Refused("no previous version is retained: nothing to roll back to")
        came_from = store.current.version
        try:
            transport = _open_record(store, prev)
        except Exception as exc:  # nothing written yet: refuse cleanly
            raise Refused(f"cannot load previous version {prev.version}: {exc}") from None
        try:
            _write_record(prev, transport, store)
        except Exception as exc:
            restored = restore_current(store)
            if restored and isinstance(exc, SourceChanged):
                raise SourceRefused(f"rollback to {prev.version} refused: {exc}; restored {came_from}",
                                    restored=True) from None  # fmt: skip
            raise WriteFailed(
                f"rollback to {prev.version} failed: {exc}; "
                + (f"restored {came_from}" if restored else f"restoring {came_from} failed too"),
                restored=restored,
            ) from None
        store.invalidate_caches()
        store.swap_current_and_previous()
    return {"version": store.current.version, "rolled_back_from": came_from,
            "duration_ms": (time.perf_counter() - t0) * 1e3}  # fmt: skip
