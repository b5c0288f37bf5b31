"""The registry questions and writes the coordinator, API and CLI need, in one place.

Every function takes an open `Session`; the caller owns the transaction
(`with registry.session() as s:`), so a step's writes commit together.
Checkpoint status is written only by `daemon.registry.status`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Column as SAColumn
from sqlalchemy import Float, Integer, MetaData, String, Table, Text, or_, select
from sqlalchemy.orm import Session

from daemon.registry import hosts
from daemon.registry.models import (
    ALIAS_NAMES,
    AdapterAlias,
    Alias,
    Check,
    Checkpoint,
    CheckpointFile,
    CheckpointStatusCount,
    Event,
    UTCDateTime,
    utcnow,
)
from daemon.registry.status import UNFINISHED, CheckpointStatus

# Checkpoints in these statuses were being processed when the daemon stopped.
UNFINISHED_STATUSES = tuple(s.value for s in UNFINISHED)

# The views, declared for reading only (their SQL lives in the migrations).
_views = MetaData()
version_history = Table(
    "version_history",
    _views,
    SAColumn("checkpoint_id", Integer),
    SAColumn("version", String),
    SAColumn("status", String),
    SAColumn("status_message", Text),
    SAColumn("step", Integer),
    SAColumn("parent", String),
    SAColumn("digest", String),
    SAColumn("total_bytes", Integer),
    SAColumn("tensor_count", Integer),
    SAColumn("source", String),
    SAColumn("commit_signal", String),
    SAColumn("local_path", Text),
    SAColumn("discovered_at", UTCDateTime),
    SAColumn("verified_at", UTCDateTime),
    SAColumn("deployed_at", UTCDateTime),
    SAColumn("verify_ms", Float),
    SAColumn("rollout_count", Integer),
    SAColumn("rolled_back_at", UTCDateTime),
    SAColumn("superseded_at", UTCDateTime),
    SAColumn("serving", Integer),
    # added by migration 0002_rollout_views
    SAColumn("last_rollout_id", Integer),
    SAColumn("last_rollout_outcome", String),
    SAColumn("worker_update_ms", Text),
)
worker_versions = Table(
    "worker_versions",
    _views,
    SAColumn("host", String),  # added by migration 0005_fleet_hosts
    SAColumn("worker", String),
    SAColumn("kind", String),
    SAColumn("url", Text),
    SAColumn("device", String),
    SAColumn("state", String),
    SAColumn("weight_version", String),
    SAColumn("version_status", String),
    SAColumn("updated_at", UTCDateTime),
    SAColumn("last_error", Text),
)


def get_checkpoint(s: Session, version: str) -> Checkpoint | None:
    return s.scalars(select(Checkpoint).where(Checkpoint.version == version)).one_or_none()


def get_checkpoint_by_id(s: Session, checkpoint_id: int) -> Checkpoint | None:
    return s.get(Checkpoint, checkpoint_id)


def record_event(
    s: Session,
    *,
    to_state: str,
    from_state: str | None = None,
    checkpoint_id: int | None = None,
    rollout_id: int | None = None,
    worker: str | None = None,
    duration_ms: float | None = None,
    detail: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> Event:
    ev = Event(
        at=at or utcnow(),
        checkpoint_id=checkpoint_id,
        rollout_id=rollout_id,
        worker=worker,
        from_state=from_state,
        to_state=to_state,
        duration_ms=duration_ms,
        detail=detail,
    )
    s.add(ev)
    return ev


def add_check(
    s: Session,
    checkpoint_id: int,
    *,
    name: str,
    ok: bool,
    detail: dict[str, Any],
    started_at: datetime,
    duration_ms: float,
    deferred: bool = False,
    status: str | None = None,
) -> Check:
    if status is None:  # pass | fail | deferred | skipped; "skipped" is ok but never "pass"
        status = "deferred" if deferred else "fail" if not ok else "skipped" if "skipped" in detail else "pass"
    row = Check(
        checkpoint_id=checkpoint_id,
        name=name,
        ok=ok,
        deferred=deferred,
        status=status,
        detail=_jsonable(detail),
        started_at=started_at,
        duration_ms=duration_ms,
    )
    s.add(row)
    return row


def replace_files(
    s: Session,
    ckpt: Checkpoint,
    files: Iterable[tuple[str, int, str | None]],
    *,
    hashes: Mapping[str, tuple[str, str]] | None = None,
) -> None:
    """Set a checkpoint's file list (path, bytes, crc32c), replacing any earlier one.

    `hashes`: path -> (hash_alg, hex) of the strong hashes computed from the bytes.
    """
    ckpt.files.clear()
    s.flush()
    for path, size, crc in files:
        alg, digest = (hashes or {}).get(path, (None, None))
        ckpt.files.append(CheckpointFile(path=path, bytes=size, crc32c=crc, hash_alg=alg, hash=digest))


def clear_checks(s: Session, checkpoint_id: int) -> None:
    """Forget check rows of an unfinished verification before it runs again."""
    for row in s.scalars(select(Check).where(Check.checkpoint_id == checkpoint_id)):
        s.delete(row)


def find_same_digest(s: Session, digest: str, exclude_id: int) -> Checkpoint | None:
    """An earlier checkpoint (not itself a duplicate or rejected) with the same content."""
    return s.scalars(
        select(Checkpoint)
        .where(
            Checkpoint.digest == digest,
            Checkpoint.id != exclude_id,
            Checkpoint.status.not_in(
                (CheckpointStatus.DUPLICATE, CheckpointStatus.REJECTED, *UNFINISHED)
            ),
        )
        .order_by(Checkpoint.id)
        .limit(1)
    ).one_or_none()


def unfinished_checkpoints(s: Session) -> Sequence[Checkpoint]:
    """Checkpoints a stopped daemon left in `discovered`/`verifying`, oldest first."""
    return by_status(s, UNFINISHED_STATUSES)


def checkpoints_with_status(s: Session, status: str) -> Sequence[Checkpoint]:
    """Checkpoints in one status, oldest first."""
    return by_status(s, (status,))


def by_status(s: Session, statuses: Sequence[str]) -> list[Checkpoint]:
    """Checkpoints in these statuses, oldest first, found through `ix_checkpoints_status` and sorted
    here: asked to sort by id, SQLite's planner (with ANALYZE's average of a fifth of the table per
    status) reads every version in id order instead, though the statuses asked for are rare."""
    return sorted(s.scalars(select(Checkpoint).where(Checkpoint.status.in_(list(statuses)))), key=lambda c: c.id)


def known_versions(s: Session) -> set[str]:
    return set(s.scalars(select(Checkpoint.version)))


def known_local_paths(s: Session) -> set[str]:
    """Every checkpoint directory this host has (its `checkpoint_locations`)."""
    return set(hosts.local_paths(s).values())


def protected_local_paths(s: Session, statuses: Iterable[str]) -> set[str]:
    """This host's directories of its aliased versions and of checkpoints in `statuses` (their
    locations only: the retention job runs every few minutes, whatever the history's length)."""
    ids = set(s.scalars(select(Alias.checkpoint_id).where(Alias.host == hosts.host_of(s))))
    ids |= {c.id for c in by_status(s, list(statuses))}
    return set(hosts.local_paths(s, ids).values())


def status_counts(s: Session) -> dict[str, int]:
    """status -> how many checkpoints have it (those that some have), as the database's triggers keep them."""
    rows = s.execute(select(CheckpointStatusCount.status, CheckpointStatusCount.n).where(CheckpointStatusCount.n != 0))
    return {status: int(n) for status, n in rows}


# how a version arrived (daemon.delta; migrations 0017, 0022): `history` rows carry these
ARRIVAL_COLUMNS = ("encoding", "delta_base", "fetched_bytes", "delta_ratio", "tensors_changed", "elements_changed",
                   "compacted_from", "compacted_bytes")  # fmt: skip


def history(
    s: Session,
    limit: int | None = None,
    newest_first: bool = True,
    checkpoint_id: int | None = None,
    adapter: str | None = None,
) -> list[dict[str, Any]]:
    """Rows of the `version_history` view as dicts (the newest `limit`, or one checkpoint's), plus
    `last_deployed_at` (the latest deploy: a rollback's or pin's time; `deployed_at` is the first)
    and `kind`, `adapter_name`, `base_model` (LoRA adapters), `encoding`, `delta_base`, `fetched_bytes`,
    `delta_ratio`, `tensors_changed`, `elements_changed`, `compacted_from`, `compacted_bytes` (delta
    checkpoints). `adapter`: only that adapter name's versions. The view computes its columns for the rows returned only (migration 0011)."""
    order = version_history.c.checkpoint_id.desc() if newest_first else version_history.c.checkpoint_id
    host = hosts.host_of(s)
    # this host's serving, in the same statement as the status: separate SELECTs are separate
    # snapshots (SQLite without BEGIN, PostgreSQL's read committed), and a status read after an
    # alias read could pair "deployed" with the moment before its version began to serve
    here_serving = or_(
        Checkpoint.id.in_(select(Alias.checkpoint_id).where(Alias.host == host, Alias.name == "serving")),
        Checkpoint.id.in_(select(AdapterAlias.checkpoint_id).where(AdapterAlias.host == host,
                                                                  AdapterAlias.name == "serving")),
    )  # fmt: skip
    q = (
        select(version_history, Checkpoint.last_deployed_at, Checkpoint.kind, Checkpoint.adapter_name,
               Checkpoint.base_model, Checkpoint.encoding, Checkpoint.delta_base, Checkpoint.fetched_bytes,
               Checkpoint.delta_ratio, Checkpoint.tensors_changed, Checkpoint.elements_changed,
               Checkpoint.compacted_from, Checkpoint.compacted_bytes, here_serving.label("here_serving"))
        .join(Checkpoint, Checkpoint.id == version_history.c.checkpoint_id)
        .order_by(order)
    )  # fmt: skip
    if checkpoint_id is not None:
        q = q.where(version_history.c.checkpoint_id == checkpoint_id)
    if adapter is not None:
        q = q.where(Checkpoint.adapter_name == adapter)
    if limit:
        q = q.limit(limit)
    rows = [dict(r) for r in s.execute(q).mappings()]
    here = hosts.local_paths(s, [r["checkpoint_id"] for r in rows] if limit or checkpoint_id is not None else None)
    for r in rows:  # the view's `serving` is "on any host"; this host's is what callers mean
        r["serving"] = int(bool(r.pop("here_serving")))
        r["local_path"] = here.get(r["checkpoint_id"], r["local_path"])
    return rows


def aliases(s: Session) -> dict[str, str | None]:
    """serving, last_good, pinned -> the version each names (None when unset)."""
    found = dict(
        s.execute(
            select(Alias.name, Checkpoint.version)
            .join(Checkpoint, Alias.checkpoint_id == Checkpoint.id)
            .where(Alias.host == hosts.host_of(s))
        ).all()
    )
    return {name: found.get(name) for name in ALIAS_NAMES}


def adapter_aliases(s: Session) -> dict[str, dict[str, str]]:
    """LoRA adapter name -> {serving|last_good|pinned: version} on this host."""
    out: dict[str, dict[str, str]] = {}
    rows = s.execute(select(AdapterAlias.adapter, AdapterAlias.name, Checkpoint.version)
                     .join(Checkpoint, Checkpoint.id == AdapterAlias.checkpoint_id)
                     .where(AdapterAlias.host == hosts.host_of(s))).all()  # fmt: skip
    for adapter, alias, version in rows:
        out.setdefault(adapter, {})[alias] = version
    return out


def worker_rows(s: Session) -> list[dict[str, Any]]:
    q = select(worker_versions).where(worker_versions.c.host == hosts.host_of(s)).order_by(worker_versions.c.worker)
    return [dict(r) for r in s.execute(q).mappings()]


def update_transports(s: Session, newest: int = 500) -> dict[str, str]:
    """Worker -> the path its last update took ("ipc", "disk", ...), from its newest UPDATED events."""
    q = (select(Event.worker, Event.detail).where(Event.to_state == "UPDATED", Event.worker.is_not(None),
                                                  Event.host == hosts.host_of(s))
         .order_by(Event.id.desc()).limit(newest))  # fmt: skip
    out: dict[str, str] = {}
    for worker, detail in s.execute(q):
        if worker not in out and isinstance(detail, dict) and detail.get("transport"):
            out[str(worker)] = str(detail["transport"])
    return out


def checks_of(s: Session, checkpoint_id: int) -> Sequence[Check]:
    return s.scalars(select(Check).where(Check.checkpoint_id == checkpoint_id).order_by(Check.id)).all()


def _jsonable(value: Any) -> Any:
    """Check details may carry Paths, tuples or numpy scalars; store plain JSON."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "item"):
        try:
            return value.item()
        except Exception:  # noqa: BLE001
            pass
    return str(value)
