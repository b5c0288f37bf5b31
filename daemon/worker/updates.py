"""The update path: request -> transport -> table check -> in-place write -> caches dropped -> version set.

Transports are picked by name from `TRANSPORTS` (name -> factory(body, store) -> WeightTransport).
Swap mode (pointer swap instead of copy) is supplied per transport through `SWAP_HANDLERS`
(name -> handler(transport, store, record) that re-points `store.params` and sets
`record.restore` / `record.release`); a transport without one refuses mode "swap".

Order of an update, all before any parameter changes except the last two steps:
1. body validated (version, transport, mode, expect);
2. transport built and its whole tensor table read (`table()`: headers / descriptor only);
3. `check_table` against the live parameters (names, shapes, dtypes, byte counts);
4. expect.tensors against the table, expect.digest against the source's digest (manifest);
5. under the store lock (the scheduler is parked between steps): write_into(params), or the
   swap handler; then every cache is invalidated and the version committed.
If step 5 fails, the previous weights are put back (the current record's `restore`, else a
fresh transport for the current record's request) before the caller hears about it; if that
fails too the store is marked unhealthy and the engine fails its requests.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.formats.checkpoint import LayoutError
from daemon.formats.safetensors import HeaderError
from daemon.transport import ipc_worker
from daemon.transport.base import TableMismatch, TransportError, WeightTransport, check_table
from daemon.transport.disk import DiskTransport
from daemon.worker.store import VersionRecord, WeightStore

log = logging.getLogger("hotswap.worker.updates")

# test hook: seconds to sleep after validation, right before the write phase starts, so a
# test can damage the source in between (a shard truncated mid-update). Unset in production.
PAUSE_BEFORE_WRITE_ENV = "HOTSWAP_WORKER_PAUSE_BEFORE_WRITE_S"

TransportFactory = Callable[[dict[str, Any], WeightStore], WeightTransport]
SwapHandler = Callable[[WeightTransport, WeightStore, VersionRecord], None]


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


class WriteFailed(UpdateError):
    """The write failed; the previous weights were restored (detail["restored"] says whether)."""

    status = 500


def _disk_from_request(body: dict[str, Any], store: WeightStore) -> WeightTransport:
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise BadRequest("disk transport needs 'path' (a checkpoint directory)")
    return DiskTransport(path)


TRANSPORTS: dict[str, TransportFactory] = {"disk": _disk_from_request, "ipc": ipc_worker.transport_from_request}
SWAP_HANDLERS: dict[str, SwapHandler] = {"ipc": ipc_worker.swap_in}


@dataclass(slots=True)
class UpdateBody:
    version: str
    transport: str
    mode: str
    expect_digest: str | None
    expect_tensors: int | None
    raw: dict[str, Any]

    @classmethod
    def parse(cls, body: Any) -> UpdateBody:
        if not isinstance(body, dict):
            raise BadRequest("update body must be a JSON object")
        version = body.get("version")
        if not isinstance(version, str) or not version.strip():
            raise BadRequest("'version' must be a non-empty string")
        transport = body.get("transport", "disk")
        if transport not in TRANSPORTS:
            raise BadRequest(f"unknown transport {transport!r}; this worker has {sorted(TRANSPORTS)}")
        mode = body.get("mode", "copy")
        if mode not in ("copy", "swap"):
            raise BadRequest(f"mode must be 'copy' or 'swap', not {mode!r}")
        if mode == "swap" and transport not in SWAP_HANDLERS:
            raise BadRequest(f"mode 'swap' is not supported for transport {transport!r}")
        expect = body.get("expect") or {}
        if not isinstance(expect, dict):
            raise BadRequest("'expect' must be an object {digest, tensors}")
        digest, tensors = expect.get("digest"), expect.get("tensors")
        if digest is not None and not isinstance(digest, str):
            raise BadRequest("expect.digest must be a string")
        if tensors is not None and (not isinstance(tensors, int) or isinstance(tensors, bool) or tensors < 0):
            raise BadRequest("expect.tensors must be a non-negative integer")
        return cls(version.strip(), transport, mode, digest, tensors, dict(body))


def open_and_validate(body: UpdateBody, store: WeightStore) -> tuple[WeightTransport, str | None]:
    """Steps 2-4: returns the transport (table read and checked) and the source digest."""
    try:
        transport = TRANSPORTS[body.transport](body.raw, store)
        table = transport.table()
    except UpdateError:
        raise
    except (HeaderError, LayoutError, TransportError, OSError, ValueError) as exc:
        raise BadRequest(f"cannot read the new weights: {exc}") from None
    try:
        check_table(table, store.params)
    except TableMismatch as exc:
        transport.close()
        raise Refused(f"tensor table does not match the served model (needs a restart rollout): {exc}") from None
    if body.expect_tensors is not None and body.expect_tensors != len(table):
        transport.close()
        raise Refused(f"expected {body.expect_tensors} tensors, the source has {len(table)}")
    digest = _source_digest(transport)
    if body.expect_digest is not None and digest is not None and digest != body.expect_digest:
        transport.close()
        raise Refused(f"expected digest {body.expect_digest}, the source's manifest says {digest}")
    return transport, digest


def _source_digest(transport: WeightTransport) -> str | None:
    fn = getattr(transport, "manifest_digest", None) or getattr(transport, "source_digest", None)
    if fn is None:
        return None
    try:
        return fn()
    except Exception as exc:
        raise BadRequest(f"cannot read the source's manifest: {exc}") from None


def apply_update(store: WeightStore, body: UpdateBody) -> dict[str, Any]:
    """Validate, then write under the store lock. Raises UpdateError subclasses."""
    t0 = time.perf_counter()
    transport, digest = open_and_validate(body, store)
    validated_ms = (time.perf_counter() - t0) * 1e3
    record = VersionRecord(
        version=body.version,
        digest=digest if digest is not None else body.expect_digest,
        transport=body.transport,
        path=body.raw.get("path") if body.transport == "disk" else None,
        mode=body.mode,
        request={k: v for k, v in body.raw.items() if k != "expect"},
    )
    delay = float(os.environ.get(PAUSE_BEFORE_WRITE_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)
    try:
        with store.lock:
            previous = store.current.version
            t1 = time.perf_counter()
            try:
                if body.mode == "swap":
                    SWAP_HANDLERS[body.transport](transport, store, record)
                else:
                    ipc_worker.before_copy(store)  # a swap may have left params on a loader buffer
                    transport.write_into(store.params)
            except Exception as exc:
                log.error("write of %s failed: %s; restoring %s", body.version, exc, previous)
                restored = restore_current(store)
                raise WriteFailed(
                    f"writing version {body.version} failed: {exc}; "
                    + (f"restored {previous}" if restored else f"restoring {previous} failed too: {store.unhealthy}"),
                    restored=restored,
                ) from None
            write_ms = (time.perf_counter() - t1) * 1e3
            store.invalidate_caches()
            store.commit(record)
    finally:
        transport.close()
    stats = getattr(transport, "last_stats", None)
    result: dict[str, Any] = {
        "version": body.version,
        "previous_version": previous,
        "duration_ms": (time.perf_counter() - t0) * 1e3,
        "validate_ms": validated_ms,
        "write_ms": write_ms,
        "transport": body.transport,
        "mode": body.mode,
        "digest": record.digest,
        "digest_checked": digest is not None,
        "tensors": store.tensors,
        "bytes": store.bytes,
    }
    if stats is not None:
        result["read_path"] = getattr(stats, "path", None)
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


def _open_record(store: WeightStore, rec: VersionRecord) -> WeightTransport | None:
    """A transport for `rec` with its table read and checked (nothing written); None when the
    record has a zero-copy `restore` instead."""
    if rec.restore is not None:
        return None
    if rec.transport not in TRANSPORTS:
        raise TransportError(f"transport {rec.transport!r} is not available to reload {rec.version}")
    transport = TRANSPORTS[rec.transport](rec.request, store)
    try:
        check_table(transport.table(), store.params)
    except BaseException:
        transport.close()
        raise
    return transport


def _write_record(rec: VersionRecord, transport: WeightTransport | None, store: WeightStore) -> None:
    if transport is None:
        assert rec.restore is not None
        rec.restore()
        return
    try:
        ipc_worker.before_copy(store)
        transport.write_into(store.params)
    finally:
        transport.close()


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
                    "duration_ms": (time.perf_counter() - t0) * 1e3, "recovered": True}
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
            raise WriteFailed(
                f"rollback to {prev.version} failed: {exc}; "
                + (f"restored {came_from}" if restored else f"restoring {came_from} failed too"),
                restored=restored,
            ) from None
        store.invalidate_caches()
        store.swap_current_and_previous()
    return {"version": store.current.version, "rolled_back_from": came_from,
            "duration_ms": (time.perf_counter() - t0) * 1e3}
