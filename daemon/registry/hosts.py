"""Host identity in the registry: every session knows its host, and what it writes is that host's.

A checkpoint is one row fleet-wide; `workers`, `aliases`, `rollouts` and `events` rows carry the
host that wrote them, and where a checkpoint's bytes are on each host is `checkpoint_locations`.
Two session hooks keep callers unchanged:

- before a flush, new `Worker`, `Alias`, `Rollout` and `Event` rows without a host get the
  session's (`s.info["host"]`, set by `Registry`);
- after a flush, a `Checkpoint.local_path` written in the session becomes this host's location
  (the registering code keeps writing `local_path` as before).

Reads of "where is it here" go through `local_path(s, checkpoint_id)`: another host's path is
never this host's.
"""

from __future__ import annotations

import socket
from collections.abc import Collection
from typing import Any

from sqlalchemy import Connection, Table, delete, event, inspect, select, update
from sqlalchemy.orm import Session, sessionmaker

from daemon.registry.models import Alias, Checkpoint, CheckpointLocation, Event, Rollout, Worker, utcnow

_STAMPED = (Worker, Alias, Rollout, Event)


def host_of(s: Session) -> str:
    """The host a session reads and writes as."""
    return str(s.info.get("host") or socket.gethostname())


def install(factory: sessionmaker[Session]) -> None:
    event.listen(factory, "before_flush", _stamp_host)
    event.listen(factory, "after_flush", _record_locations)


def _stamp_host(s: Session, _ctx: Any, _instances: Any) -> None:
    host = host_of(s)
    for obj in s.new:
        if isinstance(obj, _STAMPED) and getattr(obj, "host", None) is None:
            obj.host = host


def _record_locations(s: Session, _ctx: Any) -> None:
    for obj in (*s.new, *s.dirty):
        if not isinstance(obj, Checkpoint) or obj.id is None:
            continue
        added = inspect(obj).attrs.local_path.history.added
        if added:
            set_location(s, obj.id, added[-1], connection_level=True)


def set_location(s: Session, checkpoint_id: int, path: str | None, *, connection_level: bool = False) -> None:
    """Record (or forget, with None) where `checkpoint_id`'s bytes are on this session's host."""
    host = host_of(s)
    table = CheckpointLocation.__table__
    assert isinstance(table, Table)
    run = s.connection().execute if connection_level else s.execute
    where = (table.c.checkpoint_id == checkpoint_id) & (table.c.host == host)
    if path is None:
        run(delete(table).where(where))
        return
    done = run(update(table).where(where).values(local_path=path, recorded_at=utcnow()))
    if not done.rowcount:  # type: ignore[attr-defined]
        run(table.insert().values(checkpoint_id=checkpoint_id, host=host, local_path=path, recorded_at=utcnow()))


def record_copy(s: Session, ckpt: Checkpoint, path: str, fingerprint: str | None) -> None:
    """This host's copy of a version another host registered: its location, and (an event of
    this host's) the fingerprint its files had, which is what this host compares its copy with
    later (daemon.pipeline.rediscovery), never another host's."""
    set_location(s, ckpt.id, path)
    if fingerprint is not None:
        s.add(Event(checkpoint_id=ckpt.id, from_state=ckpt.status, to_state=ckpt.status,
                    detail={"fingerprint": fingerprint, "copy": path}))  # fmt: skip


def local_path(s: Session, checkpoint_id: int) -> str | None:
    """Where `checkpoint_id`'s bytes are on this session's host (None: not here)."""
    return s.scalar(
        select(CheckpointLocation.local_path).where(
            CheckpointLocation.checkpoint_id == checkpoint_id, CheckpointLocation.host == host_of(s)
        )
    )


def local_paths(s: Session, ids: Collection[int] | None = None) -> dict[int, str]:
    """checkpoint id -> its directory on this host, for every checkpoint that has one here (or
    for those of `ids` only: a page of history reads its own rows, not a year's)."""
    q = select(CheckpointLocation.checkpoint_id, CheckpointLocation.local_path).where(
        CheckpointLocation.host == host_of(s)
    )
    if ids is not None:
        q = q.where(CheckpointLocation.checkpoint_id.in_(list(ids)))
    return {int(i): str(p) for i, p in s.execute(q).all()}


def alias_row(s: Session, name: str) -> Alias | None:
    return s.get(Alias, (host_of(s), name))


def served_elsewhere(s: Session, checkpoint_id: int) -> list[str]:
    """Other hosts whose `serving` is `checkpoint_id` (a version they serve is never retired)."""
    return list(
        s.scalars(
            select(Alias.host).where(
                Alias.name == "serving", Alias.checkpoint_id == checkpoint_id, Alias.host != host_of(s)
            )
        )
    )


def single_host(conn: Connection) -> str | None:
    """The one host every `workers` / `aliases` row belongs to; None when none or several."""
    found = set(conn.execute(select(Worker.host).union(select(Alias.host))).scalars())
    return found.pop() if len(found) == 1 else None


def worker_row(s: Session, name: str) -> Worker | None:
    return s.scalars(select(Worker).where(Worker.host == host_of(s), Worker.name == name)).one_or_none()
