"""Migration 0011's views give the same rows as the definitions they replace (0002's
`version_history`, 0010's `fleet_versions`) over varied histories, and read only the rows asked for
(issue 28: `history -n 20` took seconds at 100,000 versions, a filtered count never finished)."""

from __future__ import annotations

import importlib.util
import random
from datetime import UTC, datetime, timedelta
from types import ModuleType
from typing import Any

import pytest
from conftest import REPO
from sqlalchemy import insert, text

from daemon.fleet.target import good
from daemon.registry import Registry
from daemon.registry.models import (
    GOOD_WHERE,
    Alias,
    Check,
    Checkpoint,
    Event,
    FleetHostReason,
    FleetTarget,
    Rollout,
    Worker,
)
from daemon.registry.status import DEPLOYABLE, CheckpointStatus

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STATUSES = [s.value for s in CheckpointStatus]


def _migration(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_t_{name}", REPO / "migrations" / "versions" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _old_views(reg: Registry) -> None:
    """0002's version_history and 0010's fleet_versions beside the new ones, as *_old."""
    views = _migration("0002_rollout_views")
    sql = views.VERSION_HISTORY.format(worker_ms=views._WORKER_MS.get(reg.dialect, views._WORKER_MS["postgresql"]))
    fleet = _migration("0010_fleet_versions_lag").FLEET_VERSIONS
    with reg.engine.begin() as c:
        c.execute(text(sql.replace("CREATE VIEW version_history", "CREATE VIEW version_history_old")))
        c.execute(text(fleet.replace("CREATE VIEW fleet_versions", "CREATE VIEW fleet_versions_old")))


def _history(reg: Registry, rng: random.Random, n: int, target: str) -> None:
    """n versions with every status, steps missing and tied, rollouts, events, checks and aliases on
    five hosts (one serving nothing), versions good only through an alias, and a fleet target."""
    rows: dict[Any, list[dict[str, Any]]] = {t: [] for t in (Checkpoint, Check, Rollout, Event, Alias, Worker)}
    for i in range(1, n + 1):
        at = T0 + timedelta(minutes=5 * i)
        verified = rng.random() < 0.8
        rows[Checkpoint].append(dict(
            id=i, version=f"v{i}", source="t", uri=f"file:///v{i}", step=None if rng.random() < 0.25 else rng.randint(1, n // 2),
            status=rng.choice(STATUSES), discovered_at=at, verified_at=at if verified else None,
            last_good_at=at if verified and rng.random() < 0.5 else None))  # fmt: skip
        rows[Check] += [dict(checkpoint_id=i, name=f"c{k}", ok=True, duration_ms=rng.random() * 100, started_at=at)
                        for k in range(rng.randint(0, 3))]  # fmt: skip
        for _ in range(rng.randint(0, 2)):
            rid = len(rows[Rollout]) + 1
            rows[Rollout].append(dict(id=rid, checkpoint_id=i, host=rng.choice(["h0", "h1", "h2"]), trigger="new",
                                      started_at=at, finished_at=at + timedelta(seconds=9),
                                      outcome=rng.choice([None, "succeeded", "failed", "rolled_back"])))  # fmt: skip
            rows[Event] += [dict(at=at, rollout_id=rid, worker=w, to_state=rng.choice(["UPDATED", "UNHEALTHY"]),
                                 duration_ms=None if rng.random() < 0.1 else rng.random() * 500)
                            for w in ("w1", "w0", "w1")]  # fmt: skip
        for state in ("rolled_back", "superseded", "verified"):
            if rng.random() < 0.3:
                rows[Event].append(dict(at=at + timedelta(seconds=rng.randint(1, 99)), checkpoint_id=i, to_state=state))
    for h in ("h0", "h1", "h2", "h3"):
        for name in ("serving", "last_good", "pinned"):
            if name == "serving" or rng.random() < 0.6:
                rows[Alias].append(dict(host=h, name=name, checkpoint_id=rng.randint(1, n), updated_at=T0))
    for h in ("h0", "h1", "h2", "h3", "h4"):  # h4: workers only, serves nothing
        rows[Worker] += [dict(host=h, name=w, url=f"http://{h}/{w}", state=rng.choice(["RUNNING", "PAUSED"]),
                              updated_at=T0) for w in ("w0", "w1")]  # fmt: skip
    with reg.engine.begin() as c:
        for model, values in rows.items():
            keys = {k for v in values for k in v}  # one statement, so every row has every key
            if values:
                c.execute(insert(model), [{k: v.get(k) for k in keys} for v in values])
        c.execute(insert(FleetHostReason), [dict(host="h1", target="v1", cause="waiting", reason="r", since=T0,
                                                 updated_at=T0)])  # fmt: skip
        if target != "none":  # an operator's target: any version at all (a rejected one too: not good)
            c.execute(insert(FleetTarget), [dict(id=1, checkpoint_id=rng.randint(1, n), set_at=T0)])
        if reg.dialect == "postgresql":  # the ids above were given: later inserts start after them
            for table in ("checkpoints", "rollouts"):
                c.execute(text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT MAX(id) FROM {table}))"))


def _rows(reg: Registry, sql: str) -> list[tuple[Any, ...]]:
    with reg.engine.connect() as c:
        return [tuple(r) for r in c.execute(text(sql))]


@pytest.mark.parametrize("seed,target", [(1, "none"), (2, "explicit"), (3, "none"), (4, "explicit"), (5, "none")])
def test_new_views_give_the_rows_of_the_old_ones(db_url: str, seed: int, target: str) -> None:
    reg = Registry(db_url, host="h0")
    reg.upgrade()
    _old_views(reg)
    _history(reg, random.Random(seed), 60, target)
    for view, order in (("version_history", "checkpoint_id"), ("fleet_versions", "host")):
        new = _rows(reg, f"SELECT * FROM {view} ORDER BY {order}")
        assert new == _rows(reg, f"SELECT * FROM {view}_old ORDER BY {order}"), view
        assert len(new) == (60 if view == "version_history" else 5)
    reg.close()


def test_the_good_index_holds_what_the_fleet_calls_good() -> None:
    # ix_checkpoints_good's predicate (models.GOOD_WHERE, 0011) is daemon.fleet.target.good() less its alias part
    statuses = [s.value for s in DEPLOYABLE if s is not CheckpointStatus.REJECTED]
    assert GOOD_WHERE.endswith(f"status IN ({', '.join(repr(s) for s in statuses)})")
    assert GOOD_WHERE == _migration("0011_views_follow_rows").GOOD_WHERE
    assert "last_good_at IS NOT NULL" in str(good())


# Each documented query with a filter computes no per-row column it does not return, and a
# newest-first page is read newest first (no sort of the whole table).
FILTERED = (
    "SELECT count(*) FROM version_history WHERE status = 'rejected'",
    "SELECT version, status_message FROM version_history WHERE status = 'rejected'",
)
PAGE = "SELECT * FROM version_history ORDER BY checkpoint_id DESC LIMIT 10"


def _plan(reg: Registry, sql: str) -> str:
    with reg.engine.connect() as c:
        if reg.dialect == "sqlite":
            return "\n".join(str(r[-1]) for r in c.execute(text(f"EXPLAIN QUERY PLAN {sql}")))
        c.execute(text("SET enable_seqscan = off"))  # the shape an index allows, not a tiny table's
        return "\n".join(str(r[0]) for r in c.execute(text(f"EXPLAIN {sql}")))


def test_filters_and_pages_read_only_their_rows(db_url: str) -> None:
    reg = Registry(db_url, host="h0")
    reg.upgrade()
    _history(reg, random.Random(7), 40, "none")
    for sql in FILTERED:
        plan = _plan(reg, sql)
        assert "SUBQUERY" not in plan and "SubPlan" not in plan and "CO-ROUTINE" not in plan, (sql, plan)
        assert "ix_checkpoints_status" in plan, (sql, plan)
    plan = _plan(reg, PAGE)
    if reg.dialect == "sqlite":
        top = plan.split("SUBQUERY")[0]  # before the per-row columns: how the rows are found
        assert "version_history" not in plan and top.startswith("SCAN c") and "TEMP B-TREE" not in top, plan
    else:
        top = plan.splitlines()[:2]
        assert top[0].startswith("Limit") and "Sort" not in top[1] and "Backward" in top[1], plan
    reg.close()


def test_status_counts_follow_every_write(db_url: str) -> None:
    # kept by triggers (0012): filled from the rows there at migration, then every insert, status
    # change and delete, whoever writes it (the ORM, or plain SQL as an older daemon or psql would)
    from alembic import command

    from daemon.registry import queries as q
    from daemon.registry import status
    from daemon.registry.db import alembic_config

    reg = Registry(db_url, host="h0")
    reg.upgrade()  # the history is written with today's models, then taken back to before 0012
    _history(reg, random.Random(9), 30, "none")
    with reg.engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0011_views_follow_rows")
    reg.upgrade()

    def grouped() -> dict[str, int]:
        with reg.engine.connect() as c:
            return {s: int(n) for s, n in c.execute(text("SELECT status, COUNT(*) FROM checkpoints GROUP BY status"))}

    def counted() -> dict[str, int]:
        with reg.session() as s:
            return q.status_counts(s)

    assert counted() == grouped() and sum(counted().values()) == 30
    with reg.session() as s:
        c = status.create(s, version="new", source="t", uri="u", local_path=None, commit_signal="marker")
        assert c is not None
        status.move(s, c, CheckpointStatus.VERIFYING)
        status.move(s, c, CheckpointStatus.REJECTED, "bad")
    with reg.engine.begin() as c:
        c.execute(text("UPDATE checkpoints SET status = 'retired' WHERE id IN (3, 4, 5)"))
        c.execute(text("UPDATE checkpoints SET status_message = 'same status' WHERE id = 6"))
        c.execute(text("INSERT INTO checkpoints (version, source, uri, status, discovered_at) "
                       "VALUES ('plain', 't', 'u', 'fetching', CURRENT_TIMESTAMP)"))  # fmt: skip
        c.execute(text("DELETE FROM checkpoints WHERE version = 'plain'"))
    assert counted() == grouped() and sum(counted().values()) == 31
    reg.close()
