"""A rollback records its own time (`last_deployed_at`) and keeps the version's first `deployed_at`;
"the version deployed before" follows the latest deploys; migration 0004 repairs old rows.
Real SQLite and PostgreSQL (db_url)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from daemon.cli.read import history_cells, ts_full
from daemon.registry import Registry, status
from daemon.registry import queries as q
from daemon.registry.journal import Journal
from daemon.registry.models import Checkpoint, CheckpointStatus

pytestmark = pytest.mark.quick

C = CheckpointStatus


def _deployed(reg: Registry, version: str) -> int:
    with reg.session() as s:
        ckpt = status.create(s, version=version, source="t", uri=f"file:///{version}", local_path=f"/{version}",
                             commit_signal="manifest")  # fmt: skip
        assert ckpt is not None
        for to in (C.VERIFYING, C.VERIFIED, C.DEPLOYED):
            status.move(s, ckpt, to)
        return ckpt.id


def _move(reg: Registry, cid: int, *moves: CheckpointStatus) -> None:
    with reg.session() as s:
        ckpt = s.get(Checkpoint, cid)
        assert ckpt is not None
        for to in moves:
            status.move(s, ckpt, to)


def _times(reg: Registry, cid: int) -> tuple[datetime | None, datetime | None]:
    with reg.session() as s:
        ckpt = s.get(Checkpoint, cid)
        assert ckpt is not None
        return ckpt.deployed_at, ckpt.last_deployed_at


def test_rollback_keeps_the_first_deploy_time(registry: Registry) -> None:
    a = _deployed(registry, "a")
    first, last = _times(registry, a)
    assert first is not None and last == first
    b = _deployed(registry, "b")
    _move(registry, a, C.RETIRED)
    _move(registry, b, C.RETIRED)
    _move(registry, a, C.DEPLOYED)  # the rollback to a
    again_first, again_last = _times(registry, a)
    assert again_first == first
    assert again_last is not None and again_last > first
    with registry.session() as s:
        row = next(r for r in q.history(s) if r["version"] == "a")
    assert row["deployed_at"] == first and row["last_deployed_at"] == again_last
    cell = history_cells(row, ts_full)["deployed"]
    assert cell.startswith(ts_full(first)) and f"again {ts_full(again_last)}" in cell


def test_previous_deployed_follows_the_latest_deploys(registry: Registry) -> None:
    a = _deployed(registry, "a")
    b = _deployed(registry, "b")
    _move(registry, a, C.RETIRED)
    _move(registry, b, C.RETIRED)
    _move(registry, a, C.DEPLOYED)  # rolled back to a: a is now the most recent deploy
    _move(registry, a, C.RETIRED)
    c = _deployed(registry, "c")
    ref = Journal(registry).previous_deployed(exclude_id=c)
    assert ref is not None and ref.version == "a"  # by first deploys it would be b


def test_0004_restores_the_first_deploy_from_the_events(db_url: str) -> None:
    from alembic import command

    from daemon.registry.db import alembic_config

    reg = Registry(db_url)
    try:
        reg.upgrade("0003_file_hashes")
        t1 = datetime(2026, 11, 1, 12, tzinfo=UTC)
        t2 = t1 + timedelta(days=3)  # a rollback wrote this over deployed_at, as 0003 did
        with reg.engine.begin() as conn:
            conn.execute(text("INSERT INTO checkpoints (version, source, uri, status, discovered_at, deployed_at) "
                              "VALUES ('old', 's', 'u', 'deployed', :t0, :t2)"),
                         {"t0": t1 - timedelta(hours=1), "t2": t2})  # fmt: skip
            cid = conn.execute(text("SELECT id FROM checkpoints WHERE version = 'old'")).scalar_one()
            for at in (t1, t2):
                conn.execute(text("INSERT INTO events (at, checkpoint_id, from_state, to_state) "
                                  "VALUES (:at, :cid, 'verified', 'deployed')"), {"at": at, "cid": cid})  # fmt: skip
            conn.execute(text("INSERT INTO checkpoints (version, source, uri, status, discovered_at) "
                              "VALUES ('never', 's', 'u2', 'verified', :t0)"), {"t0": t1})  # fmt: skip
        reg.upgrade()
        with reg.session() as s:
            rows = {r["version"]: r for r in q.history(s)}
        assert rows["old"]["deployed_at"] == t1 and rows["old"]["last_deployed_at"] == t2
        assert rows["never"]["deployed_at"] is None and rows["never"]["last_deployed_at"] is None
        with reg.engine.begin() as conn:  # and back down: deployed_at is the latest again, as 0003 had it
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0003_file_hashes")
        with reg.engine.connect() as conn:
            got = conn.execute(text("SELECT deployed_at FROM checkpoints WHERE version = 'old'")).scalar_one()
        assert got is not None and str(t2.year) in str(got)
    finally:
        reg.close()
