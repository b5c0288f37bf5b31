"""docs/security.md's database role layout, pasted as written into a real PostgreSQL (roles and
database renamed per run): the owner migrates, the fleet role runs staged decisions and sets the
target, the read role reads `status --fleet` but cannot take the decision lock, and a login
without grants cannot connect at all."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import POSTGRES_ENV, REPO
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError, ProgrammingError
from support_fleet import Fleet

from daemon.fleet.target import fleet_rows, set_fleet_target
from daemon.registry import Registry

pytestmark = [pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}"), pytest.mark.quick]


def layout(sfx: str) -> list[str]:
    """The page's SQL block, its names suffixed, as statements (`\\connect` kept as one)."""
    sql = (REPO / "docs" / "security.md").read_text().split("```postgresql\n", 1)[1].split("```", 1)[0]
    sql = re.sub(r"--[^\n]*", "", sql)
    sql = re.sub(r"\bhotswap(_owner|_fleet|_read)?\b", lambda m: f"hs{m.group(1) or '_db'}_{sfx}", sql)
    out: list[str] = []
    for part in sql.split(";"):
        for line in [x for x in part.strip().splitlines() if x.startswith("\\connect")]:
            out.append(line.strip())
        st = "\n".join(x for x in part.strip().splitlines() if not x.startswith("\\connect")).strip()
        if st:
            out.append(st)
    return out


@pytest.fixture
def server() -> Iterator[tuple[str, str]]:
    sfx = secrets.token_hex(3)
    base = make_url(os.environ[POSTGRES_ENV])
    admin = create_engine(base.set(database="postgres"), isolation_level="AUTOCOMMIT")
    yield base.render_as_string(hide_password=False).rsplit("/", 1)[0], sfx
    with admin.connect() as c:
        c.execute(text(f"DROP DATABASE IF EXISTS hs_db_{sfx} WITH (FORCE)"))
        for r in ("owner", "fleet", "read", "nobody"):
            c.execute(text(f"DROP ROLE IF EXISTS hs_{r}_{sfx}"))
    admin.dispose()


def test_the_documented_role_layout_grants_what_each_role_needs_and_no_more(
    server: tuple[str, str], tmp_path: Path
) -> None:
    base, sfx = server
    db = create_engine(f"{base}/postgres", isolation_level="AUTOCOMMIT")
    for st in layout(sfx):
        if st.startswith("\\connect"):
            db.dispose()
            db = create_engine(f"{base}/{st.split()[1]}", isolation_level="AUTOCOMMIT")
            continue
        with db.connect() as c:
            c.execute(text(st))
    with db.connect() as c:
        c.execute(text(f"CREATE ROLE hs_nobody_{sfx} LOGIN"))
    db.dispose()

    def url(role: str) -> str:
        return f"{base.replace('postgres@', f'hs_{role}_{sfx}:change-me@', 1)}/hs_db_{sfx}"

    owner = Registry(url("owner"), "h0")
    owner.upgrade()
    owner.close()
    fleet = Fleet(url("fleet"), tmp_path)  # the daemons' role: rows, never the schema
    try:
        v1 = fleet.j["host-2"].checkpoint(fleet.ids["v1"])
        assert v1 is not None and fleet.agents["host-2"].admits(v1)  # it takes the decision lock
        set_fleet_target(fleet.regs["host-0"], "v0", by="ops")
    finally:
        fleet.close()
    read = Registry(url("read"), "ops")
    try:
        assert fleet_rows(read)["target"] == "v0"
        with read.engine.connect() as c, pytest.raises(ProgrammingError, match="permission denied"):
            c.execute(text("SELECT * FROM fleet_decider FOR UPDATE"))
        with read.engine.connect() as c, pytest.raises(ProgrammingError, match="permission denied"):
            c.execute(text("INSERT INTO fleet_target (id, checkpoint_id, set_at) VALUES (2, 1, now())"))
    finally:
        read.close()
    nobody = create_engine(url("nobody").replace(":change-me", ""))
    with pytest.raises(OperationalError, match="permission denied"):
        nobody.connect()
    nobody.dispose()
