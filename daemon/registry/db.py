"""Database access: one `Registry` per process wraps the engine, sessions and migrations.

The same code runs on SQLite (default, one file in the state folder) and on
PostgreSQL (`database.url = "postgresql+psycopg://..."`).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from daemon import redact
from daemon.registry import hosts

# Shipped inside the package (daemon/migrations), so a wheel install migrates from any folder.
MIGRATIONS = resources.files("daemon") / "migrations"
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


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets the CLI read history while the daemon writes; busy_timeout rides out
    # short write locks instead of failing; foreign keys are off by default in SQLite.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database
        if db and db != ":memory:" and not db.startswith("file:"):
            Path(db).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True)


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

    def upgrade(self, revision: str = HEAD_REVISION) -> None:
        """Apply Alembic migrations up to `revision` (idempotent)."""
        from alembic import command

        try:
            with resources.as_file(MIGRATIONS) as script_dir, self.engine.begin() as conn:
                cfg = alembic_config(script_dir)
                cfg.attributes["connection"] = conn
                cfg.attributes["host"] = self.host  # existing single-host rows become this host's
                command.upgrade(cfg, revision)
        except Exception as exc:
            raise RegistryError(f"migrating database {redact_url(self.url)} failed: {one_line(exc)}") from exc
        self._adopt_single_host()

    def current_revision(self) -> str | None:
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def table_names(self) -> list[str]:
        return inspect(self.engine).get_table_names()

    def close(self) -> None:
        self.engine.dispose()


def alembic_config(script_dir: Path | None = None) -> Any:
    """Alembic config on the packaged migrations (or `script_dir`, a real directory)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(script_dir or MIGRATIONS))
    return cfg
