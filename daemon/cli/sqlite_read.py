"""`hotswap history` straight from an SQLite registry, with the standard library's sqlite3.

The registry (SQLAlchemy's ORM, the models, structlog) costs ~0.3 s of CPU to import, more than the
whole command may take (issue 36: `history` in <= 0.3 s on an idle 2-core machine). For the
default database, an SQLite file at this release's newest migration, the rows `history` prints are
read here with the same SQL that `daemon.registry.queries.history` builds, read-only. Anything
else (PostgreSQL, a URL with options, an older or newer schema, a file that is not there, any
sqlite3 error) returns None and the caller takes the registry's path, which migrates, explains
and fails as before. tests/cli/test_cli_speed.py holds both paths to the same rows.
"""

from __future__ import annotations

import socket
import sqlite3
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# The `version_history` view's columns as daemon.registry.queries declares them, then what
# `history` adds from `checkpoints`; the times come back as naive UTC text (UTCDateTime).
_VIEW = ("checkpoint_id", "version", "status", "status_message", "step", "parent", "digest", "total_bytes",
         "tensor_count", "source", "commit_signal", "local_path", "discovered_at", "verified_at",
         "deployed_at", "verify_ms", "rollout_count", "rolled_back_at", "superseded_at", "serving",
         "last_rollout_id", "last_rollout_outcome", "worker_update_ms")  # fmt: skip
_CHECKPOINT = ("last_deployed_at", "kind", "adapter_name", "base_model", "encoding", "delta_base",
               "fetched_bytes", "delta_ratio", "tensors_changed", "elements_changed", "compacted_from",
               "compacted_bytes")  # fmt: skip
_TIMES = {"discovered_at", "verified_at", "deployed_at", "rolled_back_at", "superseded_at", "last_deployed_at"}


def sqlite_file(url: str) -> Path | None:
    """The file of a plain `sqlite:///PATH` URL (no driver options), else None."""
    for prefix in ("sqlite:///", "sqlite+pysqlite:///"):
        if url.startswith(prefix) and "?" not in url and url[len(prefix):] not in ("", ":memory:"):
            return Path(url[len(prefix):]).expanduser().absolute()
    return None


def newest_revision(migrations: Path) -> str | None:
    """This release's newest migration (revision ids are the scripts' file names, as
    daemon.registry.db reads them)."""
    names = sorted(p.name[:-3] for p in (migrations / "versions").iterdir()
                   if p.name[:4].isdigit() and p.name.endswith(".py"))  # fmt: skip
    return names[-1] if names else None


def history_rows(url: str, host: str, limit: int | None, adapter: str | None) -> list[dict[str, Any]] | None:
    """`daemon.registry.queries.history(limit=, adapter=)`'s rows, or None (the registry decides)."""
    path = sqlite_file(url)
    migrations = Path(__file__).resolve().parents[2] / "migrations"
    if path is None or not path.is_file() or not (migrations / "versions").is_dir():
        return None  # an installed wheel carries its migrations elsewhere: the registry knows where
    try:
        with closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=5.0)) as conn:
            return read(conn, host, limit, adapter, newest_revision(migrations))
    except sqlite3.Error:
        return None


def read(conn: sqlite3.Connection, host: str, limit: int | None, adapter: str | None,
         newest: str | None) -> list[dict[str, Any]] | None:  # fmt: skip
    """One read transaction (sqlite3 begins none for a SELECT): a row's status and this host's
    `serving` come from the same moment, as queries.history's single statement does."""
    conn.execute("BEGIN")
    try:
        return _read(conn, host, limit, adapter, newest)
    finally:
        conn.rollback()


def _read(conn: sqlite3.Connection, host: str, limit: int | None, adapter: str | None,
          newest: str | None) -> list[dict[str, Any]] | None:  # fmt: skip
    if [r[0] for r in conn.execute("SELECT version_num FROM alembic_version")] != [newest]:
        return None  # an older database (the registry migrates it) or a newer one (it warns)
    if not host:  # a single-host database is that host's (daemon.registry.db adopts it the same way)
        found = {r[0] for r in conn.execute("SELECT host FROM workers UNION SELECT host FROM aliases")}
        host = found.pop() if len(found) == 1 else socket.gethostname()
    cols = ", ".join([*(f"v.{c}" for c in _VIEW), *(f"c.{c}" for c in _CHECKPOINT)])
    sql = f"SELECT {cols} FROM version_history v JOIN checkpoints c ON c.id = v.checkpoint_id"  # noqa: S608
    params: dict[str, Any] = {"adapter": adapter, "limit": limit or -1}  # LIMIT -1: no limit
    sql += (" WHERE c.adapter_name = :adapter" if adapter is not None else "") + " ORDER BY v.checkpoint_id DESC"
    rows = [dict(zip((*_VIEW, *_CHECKPOINT), r, strict=True)) for r in conn.execute(sql + " LIMIT :limit", params)]
    serving = {r[0] for r in conn.execute(
        "SELECT checkpoint_id FROM aliases WHERE host = :h AND name = 'serving' UNION "
        "SELECT checkpoint_id FROM adapter_aliases WHERE host = :h AND name = 'serving'", {"h": host})}  # fmt: skip
    located = "SELECT checkpoint_id, local_path FROM checkpoint_locations WHERE host = ?"
    here: dict[int, str] = {} if limit else dict(conn.execute(located, [host]))
    ids = [r["checkpoint_id"] for r in rows] if limit else []
    for start in range(0, len(ids), 500):  # a page reads its own rows' (500: under SQLite's bound-parameter cap)
        chunk = ids[start:start + 500]
        here.update(conn.execute(f"{located} AND checkpoint_id IN ({', '.join('?' * len(chunk))})", [host, *chunk]))
    for r in rows:  # as queries.history: this host's `serving` and its own copy's folder
        r["serving"] = int(r["checkpoint_id"] in serving)
        r["local_path"] = here.get(r["checkpoint_id"], r["local_path"])
        for key in _TIMES & r.keys():
            if isinstance(r[key], str):
                r[key] = datetime.fromisoformat(r[key]).replace(tzinfo=UTC)
    return rows
