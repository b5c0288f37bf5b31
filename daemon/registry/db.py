"""Database access: one `Registry` per process wraps the engine, sessions and migrations.

The same code runs on SQLite (default, one file in the state folder, 0600 with its -wal and -shm)
and on PostgreSQL (`database.url = "postgresql+psycopg://..."`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, exc, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from daemon.common import FILE_MODE, get_logger, open_private, private_dir, redact, tighten
from daemon.registry import hosts
from daemon.registry.migratelock import migration_lock
from daemon.registry.outbox import Outbox

log = get_logger(__name__)


def _migrations() -> Path | Traversable:
    """The Alembic scripts. In a source tree they are the repository's top-level `migrations/`;
    a wheel carries them as the package `daemon.migrations` (setup.py maps that folder into the
    package), so an installed daemon migrates from any folder."""
    tree = Path(__file__).resolve().parents[2] / "migrations"
    if (tree / "env.py").is_file() and (tree / "versions" / "0001_initial.py").is_file():
        return tree
    return resources.files("daemon.migrations")


MIGRATIONS = _migrations()
HEAD_REVISION = "head"


class RegistryError(RuntimeError):
    """The registry database cannot be opened or migrated; the message names the URL."""


def redact_url(url: str) -> str:
    """The URL with any password hidden (user:password@ and ?password=...), for logs and errors."""
    return redact.redact_url(url)


def one_line(exc: BaseException) -> str:
    """A driver error as one line: the driver's own message, without SQLAlchemy's background link."""
    msg = str(getattr(exc, "orig", None) or exc)
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip() and "sqlalche.me" not in ln]
    return "; ".join(lines) or type(exc).__name__


SQLITE_BUSY_MS = 10_000  # how long any statement, the first pragma included, waits on another's lock


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets the CLI read history while the daemon writes; busy_timeout rides out
    # short write locks instead of failing; foreign keys are off by default in SQLite.
    # busy_timeout first: switching to WAL (or finding it on) waits on the lock of a process that
    # is checkpointing as the last to close (a migration's WAL under load), not only 5 s
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_MS}")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def private_sqlite_file(path: Path) -> None:
    """The database file 0600 before SQLite opens it: SQLite gives its -wal and -shm files the mode of
    the database file, so all three are closed to other users whatever the umask. An existing file
    of ours that is looser (an install from before) is tightened, with its -wal/-shm, and logged."""
    if not path.parent.is_dir():
        private_dir(path.parent)  # made for it (the state directory, usually): 0700
    with contextlib.suppress(FileExistsError):
        os.close(open_private(path, os.O_RDWR | os.O_EXCL))
        return
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm"),
              path.with_name(path.name + "-journal")):  # fmt: skip
        try:
            was = tighten(p, FILE_MODE)
        except OSError as exc:  # not ours to change (another user's CLI): SQLite decides
            log.warning("cannot tighten the database file", path=str(p), error=exc.strerror)
            continue
        if was is not None:
            log.warning("database file was open to other users; tightened to 0600", path=str(p), mode=f"{was:04o}")


def make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database
        if db and db != ":memory:" and not db.startswith("file:"):
            private_sqlite_file(Path(db).expanduser())
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_MS / 1000})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    query = dict(parsed.query)
    threshold = query.pop(PREPARE_THRESHOLD, None)
    if threshold is None:
        engine = create_engine(url, pool_use_lifo=True)
    else:  # psycopg would get the URL's text as is (and fail on its first statement's `count >= "0"`)
        engine = create_engine(parsed.set(query=query), pool_use_lifo=True,
                               connect_args={PREPARE_THRESHOLD: prepare_threshold(threshold, url)})  # fmt: skip
    ping_when_idle(engine)
    event.listen(engine, "connect", _postgres_session)
    return engine


def _postgres_session(dbapi_conn: Any, _record: Any) -> None:
    """JIT off for this session: the registry's statements are short lookups, and PostgreSQL's JIT
    (on once a plan's estimated cost passes `jit_above_cost`, as `fleet_versions`' does) spent ~80 ms
    compiling a 2 ms query at 1,000,000 versions (bench/RESULTS.md, "Registry at scale")."""
    autocommit = dbapi_conn.autocommit
    dbapi_conn.autocommit = True  # its own statement, no transaction left open
    try:
        cursor = dbapi_conn.cursor()  # DB-API: psycopg 3 and psycopg2 alike
        cursor.execute("SET jit = off")
        cursor.close()
    finally:
        dbapi_conn.autocommit = autocommit


PING_IDLE_S = 1.0  # a pooled connection unused for longer is checked with a round trip before use


def ping_when_idle(engine: Engine) -> None:
    """`pool_pre_ping`, but only for a connection that sat in the pool for more than PING_IDLE_S.

    A fleet agent's look is ~10 short sessions in a row every poll_s: pre-pinging each doubled its
    round trips (issue 28, bench/fleet_sim.py). A connection the server or a pooler closed while it
    sat idle (a restart, idle timeouts) is still found before use and replaced; one closed within the
    last second fails its statement, which invalidates it like any disconnect. The pool hands out
    the connection used last (`pool_use_lifo`): sessions in a row reuse one, the others stay idle."""

    def checkin(_dbapi: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    def checkout(dbapi: Any, record: Any, _proxy: Any) -> None:
        since = record.info.pop("idle_since", None)
        if since is None or time.monotonic() - since <= PING_IDLE_S:
            return  # just connected, or used a moment ago
        try:
            engine.dialect.do_ping(dbapi)
        except Exception as e:  # noqa: BLE001 - any failure: the pool drops it and connects anew
            raise exc.DisconnectionError(f"pooled connection gone: {one_line(e)}") from e

    event.listen(engine.pool, "checkin", checkin)
    event.listen(engine.pool, "checkout", checkout)


PREPARE_THRESHOLD = "prepare_threshold"


def prepare_threshold(value: str | tuple[str, ...], url: str) -> int | None:
    """`?prepare_threshold=none` on a PostgreSQL URL: psycopg never prepares statements on the server,
    which a pooler in transaction mode needs (PgBouncer before 1.21 hands each transaction any server
    connection, where `_pg3_0` was never prepared). A number: prepare after that many executions."""
    text_value = value[-1] if isinstance(value, tuple) else value
    if text_value.strip().lower() in ("none", "off", ""):
        return None
    try:
        return int(text_value)
    except ValueError:
        raise RegistryError(f"database URL {redact_url(url)}: prepare_threshold must be a number or 'none', "
                            f"not {text_value!r}") from None  # fmt: skip


class Registry:
    """The registry database: `with registry.session() as s: ...` commits on success.

    A registry is bound to one host (`[fleet] host`, default this machine's hostname): its
    sessions carry it (`s.info["host"]`), so workers, aliases, rollouts, events and checkpoint
    locations are read and written as this host's (daemon.registry.hosts).

    SQLite is one machine's file: without an explicit host, a registry on an SQLite database
    whose rows all belong to one host takes that host's name (a container's hostname changes
    with every new container; the state directory, and what it serves, stays).
    """

    def __init__(self, url: str, host: str | None = None) -> None:
        self.url = url
        self.explicit_host = bool(host)
        self.host = host or socket.gethostname()
        try:
            self.engine = make_engine(url)
        except Exception as exc:
            raise RegistryError(f"cannot open database {redact_url(url)}: {one_line(exc)}") from exc
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.outbox = Outbox()  # writes kept while the database is out (daemon.registry.outbox)
        hosts.install(self._sessions)
        self._adopt_single_host()

    def _adopt_single_host(self) -> None:
        if self.explicit_host or self.engine.dialect.name != "sqlite":
            return
        db = make_url(self.url).database
        if not db or db == ":memory:" or db.startswith("file:") or not Path(db).expanduser().is_file():
            return  # nothing written yet (and opening it would create the file)
        try:
            with self.engine.connect() as conn:
                found = hosts.single_host(conn)
        except Exception:  # noqa: BLE001 - no tables yet, or a database before 0005: keep the hostname
            return
        if found:
            self.host = found

    def listen(self, name: str, fn: Any) -> None:
        """A session event hook on every session of this registry (daemon.webhooks.outbox)."""
        event.listen(self._sessions, name, fn)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def session(self) -> Iterator[Session]:
        s = self._sessions(info={"host": self.host})
        try:
            yield s
            s.commit()
        except BaseException:
            s.rollback()
            raise
        finally:
            s.close()

    @contextmanager
    def snapshot(self) -> Iterator[Session]:
        """A read-only session whose statements all see one moment (a document read in several
        SELECTs: apart, each is its own snapshot under SQLite without BEGIN and PostgreSQL's read
        committed, and could pair a status with an alias of another moment). Rolled back."""
        s = self._sessions(info={"host": self.host})
        try:
            if self.dialect == "sqlite":
                s.connection().exec_driver_sql("BEGIN")  # pysqlite begins only before a write
            else:
                s.connection(execution_options={"isolation_level": "REPEATABLE READ"})
            yield s
        finally:
            s.rollback()
            s.close()

    def answers(self) -> bool:
        """`SELECT 1` works (reads; a read-only or full database still answers)."""
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception:  # noqa: BLE001 - any failure is "does not answer"
            return False
        return True

    def wait_until_writable(self, stop: threading.Event, every_s: float = 1.0) -> bool:
        """Block until the database answers and every write kept through an outage is recorded
        (daemon.registry.outbox). False when `stop` was set first."""
        while not stop.is_set():
            if self.answers() and self.outbox.flush():
                return True
            stop.wait(every_s)
        return False

    def upgrade(self, revision: str = HEAD_REVISION) -> None:
        """Apply Alembic migrations up to `revision` (idempotent). One process at a time per
        database (daemon.registry.migratelock): the lock is taken before the migration's
        transaction begins and released after it committed, so processes started together on a
        fresh database all succeed (the first migrates, the others then find it at head)."""
        if revision == HEAD_REVISION and self._at_newest():
            self._adopt_single_host()  # nothing to migrate: no Alembic (every CLI call asks)
            return
        from alembic import command

        try:
            with (
                resources.as_file(MIGRATIONS) as script_dir,
                migration_lock(self.engine),
                self.engine.begin() as conn,
            ):
                cfg = alembic_config(script_dir)
                cfg.attributes["connection"] = conn
                cfg.attributes["host"] = self.host  # existing single-host rows become this host's
                unknown, at_head = revision_state(cfg, conn)
                if unknown:  # a newer release migrated it: run on it as is
                    log.warning("database_newer_than_this_daemon", revisions=unknown, database=redact_url(self.url),
                                note="its migrations are additive first, so this release keeps working; upgrade it")  # fmt: skip
                elif not (at_head and revision == HEAD_REVISION):  # at head: nothing to run (every CLI call asks)
                    command.upgrade(cfg, revision)
        except Exception as exc:
            raise RegistryError(f"migrating database {redact_url(self.url)} failed: {one_line(exc)}") from exc
        self._adopt_single_host()

    def _at_newest(self) -> bool:
        """The database is at this release's newest migration (one SELECT; revision ids are the
        scripts' file names). False whenever unsure: Alembic then decides."""
        names = sorted(p.name[:-3] for p in MIGRATIONS.joinpath("versions").iterdir()
                       if p.name[:4].isdigit() and p.name.endswith(".py"))  # fmt: skip
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
        except Exception:  # noqa: BLE001 - no table yet (a new database), or not reachable: Alembic says
            return False
        return bool(names) and list(rows) == [names[-1]]

    def current_revision(self) -> str | None:
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def table_names(self) -> list[str]:
        return inspect(self.engine).get_table_names()

    def close(self) -> None:
        self.engine.dispose()


def revision_state(cfg: Any, conn: Any) -> tuple[list[str], bool]:
    """(the database's revisions these migrations do not have: a newer hotswap's, expand first and
    contract a release later, docs/how-to/upgrading.md; whether it is at these migrations' head)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(cfg)
    known = {s.revision for s in script.walk_revisions()}
    current = MigrationContext.configure(conn).get_current_heads()
    return [r for r in current if r not in known], set(current) == set(script.get_heads())


def alembic_config(script_dir: Path | None = None) -> Any:
    """Alembic config on the packaged migrations (or `script_dir`, a real directory)."""
    from alembic.config import Config

    cfg = Config(stdout=sys.stdout)  # now: alembic's default is the sys.stdout of its import time
    cfg.set_main_option("script_location", str(script_dir or MIGRATIONS))
    return cfg
