"""The registry's PostgreSQL sessions run with JIT off (daemon.registry.db._postgres_session): at
1,000,000 versions PostgreSQL spent ~80 ms compiling `fleet_versions`' 2 ms plan. Pooled
connections keep it, and a session's own transactions are unaffected by how it was set."""

from __future__ import annotations

import os

import pytest
from conftest import POSTGRES_ENV
from sqlalchemy import text

from daemon.registry import Registry

pytestmark = [pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}"), pytest.mark.quick]


def test_every_registry_session_has_jit_off(pg_url: str) -> None:
    reg = Registry(pg_url)
    try:
        reg.upgrade()
        for _ in range(3):  # a new connection, then the pooled one again
            with reg.engine.connect() as c:
                assert c.execute(text("SHOW jit")).scalar_one() == "off"
                assert c.execute(text("SELECT count(*) FROM fleet_versions")).scalar_one() == 0
        with reg.session() as s:  # a session's transaction still commits what it wrote
            s.execute(text("INSERT INTO fleet_host_reasons (host, target, cause, reason, since, updated_at) "
                           "VALUES ('h', 'v1', 'next', 'r', now(), now())"))  # fmt: skip
        with reg.engine.connect() as c:
            assert c.execute(text("SELECT count(*) FROM fleet_host_reasons")).scalar_one() == 1
    finally:
        reg.close()
