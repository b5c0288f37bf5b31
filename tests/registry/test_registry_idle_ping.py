"""A pooled PostgreSQL connection is pinged before use only when it sat idle for more than
PING_IDLE_S (issue 28: pre-pinging every checkout doubled a fleet agent's round trips), and a
connection the server closed while idle is still replaced before a session uses it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import POSTGRES_ENV, _postgres_database
from sqlalchemy import create_engine, text

from daemon.registry import Registry
from daemon.registry import db as registry_db

pytestmark = pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")


@pytest.fixture
def registry() -> Iterator[Registry]:
    for url in _postgres_database(os.environ[POSTGRES_ENV]):
        reg = Registry(url, "host-a")
        reg.upgrade()
        yield reg
        reg.close()


def counted_pings(reg: Registry) -> list[float]:
    pings: list[float] = []
    real = reg.engine.dialect.do_ping

    def ping(dbapi: Any) -> bool:
        pings.append(time.monotonic())
        return real(dbapi)

    reg.engine.dialect.do_ping = ping  # type: ignore[method-assign]
    return pings


def backend_pid(reg: Registry) -> int:
    with reg.session() as s:
        return int(s.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_sessions_in_a_row_are_not_pinged_an_idle_connection_is(registry: Registry) -> None:
    pings = counted_pings(registry)
    backend_pid(registry)  # connected: nothing to ping
    for _ in range(10):  # one fleet agent look: short sessions one after another
        backend_pid(registry)
    assert pings == []
    time.sleep(registry_db.PING_IDLE_S + 0.3)
    backend_pid(registry)
    backend_pid(registry)
    assert len(pings) == 1  # the first use after a pause only


def test_a_connection_closed_while_idle_is_replaced_before_use(registry: Registry) -> None:
    first = backend_pid(registry)
    admin = create_engine(registry.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:  # the server drops it (a restart, an idle timeout, a pooler)
        assert conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": first}).scalar_one()
    admin.dispose()
    time.sleep(registry_db.PING_IDLE_S + 0.3)
    again = backend_pid(registry)  # no error: the ping found it gone and the pool connected anew
    assert again != first
