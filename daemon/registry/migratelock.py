"""One migration at a time per database, so any number of daemons (and `hotswap db upgrade` or
`alembic upgrade` runs) may start together on one database.

Without it two processes on a fresh database both saw no `alembic_version` and both ran the
first migration: on PostgreSQL the loser died with `duplicate key value violates unique
constraint "pg_type_typname_nsp_index"`, on SQLite with `table checkpoints already exists`.
With it the first migrates and the others wait, then find the schema at head and do nothing.

    PostgreSQL   a session-level advisory lock (`pg_advisory_lock(MIGRATION_LOCK_KEY)`) on a
                 connection of its own (autocommit, so it never sits idle in a transaction),
                 taken before the migration's transaction begins and released after it
                 committed. Advisory locks are per database, so other databases on the server
                 are not held up; a holder that dies releases it with its session.
    SQLite       an exclusive `flock` on `<database file>.migrate.lock` (created next to the
                 database, 0600, left in place: removing a lock file races its next taker);
                 the kernel releases it when the holder dies. In-memory databases need none.

The wait has no timeout of its own: a migration runs as long as it runs, and a waiter that
gives up would only fail the start the lock is there to save. Waiting is logged once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import URL

log = logging.getLogger("hotswap.registry.migrate")

# Fixed for every hotswap registry: b"hotswap" + 0x01 as a signed 64-bit key (pg_advisory_lock(bigint)).
MIGRATION_LOCK_KEY = 0x686F7473776170_01


@contextlib.contextmanager
def migration_lock(engine: Engine) -> Iterator[None]:
    """Hold the database's migration lock for the body (run the migration, commit, then leave)."""
    name = engine.dialect.name
    if name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn, _advisory_lock(conn):
            yield
    elif name == "sqlite" and (path := lock_file(engine.url)) is not None:
        with _file_lock(path):
            yield
    else:
        yield


def lock_file(url: URL) -> Path | None:
    """`<database>.migrate.lock` for an SQLite file database; None for an in-memory one."""
    db = url.database or ""
    if db.startswith("file:"):  # a URI filename (uri=true): file:PATH?mode=...
        if "mode=memory" in db:
            return None
        db = db.removeprefix("file:").partition("?")[0]
    if not db or db == ":memory:":
        return None
    return Path(db).expanduser().with_name(Path(db).name + ".migrate.lock")


@contextlib.contextmanager
def _advisory_lock(conn: Connection) -> Iterator[None]:
    key = {"k": MIGRATION_LOCK_KEY}
    if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), key).scalar():
        log.info("another process is migrating this database; waiting for it (advisory lock %d)", MIGRATION_LOCK_KEY)
        t0 = time.monotonic()
        conn.execute(text("SELECT pg_advisory_lock(:k)"), key)
        log.info("migration lock taken after %.1f s", time.monotonic() - t0)
    try:
        yield
    finally:
        # a broken connection ended its session, and the lock with it
        with contextlib.suppress(Exception):
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), key)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is migrating this database; waiting for it (%s)", path)
            t0 = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            log.info("migration lock taken after %.1f s", time.monotonic() - t0)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the flock
