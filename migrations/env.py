"""Alembic environment for the hotswap registry.

The database URL comes from, in order: a connection handed in by
`daemon.registry.db.Registry.upgrade()` (config attribute "connection"),
`alembic -x url=...`, `alembic -x config=/etc/hotswap/config.toml` (the URL the daemon
would use with it: `[database] url`, else SQLite in its state_dir), `sqlalchemy.url` in
alembic.ini, else the daemon's default config (`$HOTSWAP_CONFIG`, else ./state/hotswap.db).

Run from the command line, it takes the daemon's migration lock (daemon.registry.migratelock)
around the migration; a handed-in connection runs under its caller's lock.
"""

from __future__ import annotations

from alembic import context

from daemon.registry.db import make_engine
from daemon.registry.migratelock import migration_lock
from daemon.registry.models import Base

target_metadata = Base.metadata
config = context.config


def _url() -> str:
    x = context.get_x_argument(as_dictionary=True)
    if x.get("url"):
        return x["url"]
    from daemon.config import load_config  # late: only needed on the command line

    # `database_url`, not `database.url`: the latter is "" when the config leaves the
    # default (SQLite in the state dir), and alembic would then get an empty URL.
    if x.get("config"):
        loaded = load_config(x["config"])
        config.attributes.setdefault("host", loaded.fleet.host_name)  # 0005: existing rows' host
        return loaded.database_url
    ini_url = config.get_main_option("sqlalchemy.url")
    if ini_url:
        return ini_url
    return load_config(None).database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url())  # the daemon's own: creates the SQLite folder, same pragmas
    try:
        # the daemon's migration lock too, so `alembic upgrade` by hand waits for a starting daemon
        with migration_lock(engine), engine.connect() as conn:
            context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
