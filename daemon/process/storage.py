"""Where the daemon writes, as problems: the registry refusing writes, and the state directory's disk.

    database_unwritable   critical  writes kept in memory because the database refused them
                                    (daemon.registry.outbox: read-only, disk full, gone), or
                                    the SQLite file cannot be opened for writing now
    state_disk_full       critical  the state directory's filesystem has under MIN_FREE_BYTES free
                                    (the SQLite registry, worker logs and runtime files live there)

`SELECT 1` (daemon.process.health, database_unreachable) answers on a read-only or full
database, so a registry that reads but cannot write was green while every transition and
every new checkpoint failed to be recorded. These probes are a stat and an access(2) each, never an
open of the database file: they run on every `/health`.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.engine import make_url

from daemon.common import Problem
from daemon.registry import Registry

MIN_FREE_BYTES = 1 << 20  # under this, SQLite cannot grow its WAL by a page batch: writes fail


def storage_problems(registry: Registry, state_dir: Path | None) -> list[Problem]:
    out: list[Problem] = []
    box = registry.outbox
    if box.pending():
        out.append(Problem("database_unwritable", "registry",
                           f"{box.pending()} writes kept in memory until the database takes them: {box.last_error}"))  # fmt: skip
    elif (why := _sqlite_unwritable(registry)) is not None:
        out.append(Problem("database_unwritable", "registry", why))
    for where in {p for p in (state_dir, _sqlite_dir(registry)) if p is not None}:
        try:
            st = os.statvfs(where)
        except OSError:
            continue  # a missing folder is another probe's to say (preflight refuses it at start)
        free = st.f_bavail * st.f_frsize
        if free < MIN_FREE_BYTES:
            out.append(Problem("state_disk_full", str(where),
                               f"{free} bytes free on the filesystem of {where}: nothing more can be recorded"))  # fmt: skip
    return out


def _sqlite_path(registry: Registry) -> Path | None:
    url = make_url(registry.url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    if url.database.startswith("file:"):
        return None
    return Path(url.database).expanduser()


def _sqlite_dir(registry: Registry) -> Path | None:
    path = _sqlite_path(registry)
    return path.parent if path is not None else None


def _sqlite_unwritable(registry: Registry) -> str | None:
    """Asks the kernel (access(2)) whether the file could be opened for writing, never opening it:
    closing any descriptor of the database file drops every POSIX lock this process's SQLite
    connections hold on it (sqlite.org/howtocorrupt.html 2.2), and another process (the CLI) then
    took itself for the last connection and deleted the WAL the daemon was still writing to."""
    path = _sqlite_path(registry)
    if path is None:
        return None
    effective = os.access in os.supports_effective_ids  # the daemon's user, not a setuid caller's
    for p in (path, path.with_name(path.name + "-wal")):
        if not p.exists():
            continue
        if not os.access(p, os.W_OK, effective_ids=effective):
            why = "read-only file system" if _read_only_fs(p) else "permission denied or immutable"
            return f"{p} cannot be opened for writing ({why}): no transition or checkpoint can be recorded"
    return None


def _read_only_fs(p: Path) -> bool:
    try:
        return bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        return False
