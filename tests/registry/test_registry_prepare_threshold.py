"""`?prepare_threshold=none` on a PostgreSQL URL (PgBouncer in transaction mode, issue 28): it
reaches psycopg as a number or None, not as the URL's text, and the rest of the URL is kept."""

from __future__ import annotations

import os

import pytest
from conftest import POSTGRES_ENV, _postgres_database
from sqlalchemy import text

from daemon.registry import Registry
from daemon.registry.db import RegistryError, make_engine, prepare_threshold


def test_the_value_is_a_number_or_none() -> None:
    assert prepare_threshold("none", "u") is None and prepare_threshold("None", "u") is None
    assert prepare_threshold("0", "u") == 0 and prepare_threshold(("5", "7"), "u") == 7
    with pytest.raises(RegistryError, match="prepare_threshold must be a number or 'none'"):
        prepare_threshold("soon", "postgresql+psycopg://u:secret@h/db")


def test_the_url_keeps_everything_else() -> None:
    engine = make_engine("postgresql+psycopg://u@127.0.0.1:6432/db?prepare_threshold=none&application_name=x")
    assert "prepare_threshold" not in engine.url.query and engine.url.query["application_name"] == "x"
    assert engine.url.port == 6432 and engine.url.database == "db"
    assert make_engine("postgresql+psycopg://u@h/db").url.query == {}


@pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")
def test_psycopg_gets_it_and_never_prepares() -> None:
    for url in _postgres_database(os.environ[POSTGRES_ENV]):
        reg = Registry(url + "?prepare_threshold=none", "host-a")
        try:
            reg.upgrade()
            with reg.engine.connect() as conn:
                assert conn.connection.dbapi_connection.prepare_threshold is None  # type: ignore[union-attr]
                for _ in range(10):  # psycopg's default prepares from the 5th execution on
                    conn.execute(text("SELECT count(*) FROM fleet_leases"))
                assert conn.execute(text("SELECT count(*) FROM pg_prepared_statements")).scalar() == 0
        finally:
            reg.close()
