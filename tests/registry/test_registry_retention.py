"""Retention of the registry's history (daemon.registry.retention, `[database] retention_days`): old
events and checks rows go, in batches; every version's own row, files and rollouts stay; the rows of
serving, last_good and pinned versions (any host's), of the fleet target and of in-flight versions
and rollouts stay whatever their age. SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from conftest import make_config_file
from sqlalchemy import func, select, text, update

from daemon.config import ConfigError, load_config
from daemon.registry import Check, Checkpoint, Event, Registry, Rollout, status, utcnow
from daemon.registry import queries as q
from daemon.registry.journal import Journal
from daemon.registry.models import FleetTarget
from daemon.registry.retention import Pruned, prune
from daemon.registry.status import CheckpointStatus as C
from daemon.registry.status import RolloutOutcome, RolloutTrigger

OLD = utcnow() - timedelta(days=90)
PATHS = {
    "plain": (C.VERIFYING, C.VERIFIED, C.DEPLOYED, C.RETIRED),
    "rejected": (C.VERIFYING, C.REJECTED),
    "serving_a": (C.VERIFYING, C.VERIFIED, C.DEPLOYED),
    "last_good_b": (C.VERIFYING, C.VERIFIED, C.DEPLOYED, C.RETIRED),
    "pinned_a": (C.VERIFYING, C.VERIFIED, C.DEPLOYED, C.RETIRED),
    "target": (C.VERIFYING, C.VERIFIED, C.DEPLOYED, C.RETIRED),
    "verifying": (C.VERIFYING,),
    "rolling_out": (C.VERIFYING, C.VERIFIED, C.DEPLOYED, C.RETIRED),  # being rolled back to
    "recent": (C.VERIFYING, C.VERIFIED, C.DEPLOYED, C.RETIRED),
}


def _history(db_url: str) -> tuple[Registry, dict[str, int]]:
    """One version per entry of PATHS with 3 checks and a rollout (3 worker events), all of it 90
    days old but "recent"; host a serves serving_a and pins pinned_a, host b's last_good is
    last_good_b, the fleet target is `target`, and rolling_out's rollout has not finished."""
    reg = Registry(db_url, "a")
    reg.upgrade()
    ids: dict[str, int] = {}
    journal = Journal(reg)
    for name, moves in PATHS.items():
        with reg.session() as s:
            c = status.create(s, version=name, source="t", uri=f"file:///{name}", local_path=f"/{name}",
                              commit_signal="manifest")  # fmt: skip
            assert c is not None
            for to in moves:
                status.move(s, c, to)
            for k in range(3):
                q.add_check(s, c.id, name=f"c{k}", ok=True, detail={}, started_at=utcnow(), duration_ms=1.0)
            ids[name] = c.id
        rid = journal.start_rollout(ids[name], trigger=RolloutTrigger.NEW, transport="disk", mode="drain", detail={})
        for to in ("DRAINING", "UPDATED", "RUNNING"):
            journal.transition(rollout_id=rid, worker="w0", from_state=None, to_state=to, duration_ms=1.0)
        if name != "rolling_out":
            journal.finish_rollout(rid, RolloutOutcome.SUCCEEDED)
    journal.set_alias("serving", ids["serving_a"])
    journal.set_alias("pinned", ids["pinned_a"])
    Journal(Registry(db_url, "b")).set_alias("last_good", ids["last_good_b"])
    with reg.session() as s:
        s.add(FleetTarget(id=1, checkpoint_id=ids["target"], set_at=utcnow()))
        old = [i for n, i in ids.items() if n != "recent"]
        s.execute(update(Checkpoint).where(Checkpoint.id.in_(old)).values(discovered_at=OLD))
        s.execute(update(Check).where(Check.checkpoint_id.in_(old)).values(started_at=OLD))
        rollouts = select(Rollout.id).where(Rollout.checkpoint_id.in_(old))
        s.execute(update(Event).where(Event.checkpoint_id.in_(old) | Event.rollout_id.in_(rollouts)).values(at=OLD))
        q.record_event(s, worker="w0", from_state="RUNNING", to_state="UNREACHABLE")  # a health poll's, now
        s.flush()
        q.record_event(s, worker="w0", from_state="UNREACHABLE", to_state="RUNNING")
        s.flush()
        s.execute(update(Event).where(Event.rollout_id.is_(None), Event.checkpoint_id.is_(None),
                                      Event.to_state == "RUNNING").values(at=OLD))  # fmt: skip
    return reg, ids


def _rows(reg: Registry, ids: dict[str, int]) -> dict[str, tuple[int, int]]:
    """version -> (its events, status and its rollouts' worker transitions; its checks)."""
    out = {}
    with reg.session() as s:
        for name, cid in ids.items():
            rollouts = select(Rollout.id).where(Rollout.checkpoint_id == cid)
            events = s.scalar(select(func.count()).select_from(Event)
                              .where((Event.checkpoint_id == cid) | Event.rollout_id.in_(rollouts)))  # fmt: skip
            checks = s.scalar(select(func.count()).select_from(Check).where(Check.checkpoint_id == cid))
            out[name] = (int(events or 0), int(checks or 0))
    return out


@pytest.mark.parametrize("batch", [5000, 2])
def test_old_rows_go_and_protected_ones_stay(db_url: str, batch: int) -> None:
    reg, ids = _history(db_url)
    before = _rows(reg, ids)
    assert all(events >= 5 and checks == 3 for events, checks in before.values()), before
    done = prune(reg, keep_days=30, batch=batch)
    after = _rows(reg, ids)
    gone = {"plain", "rejected"}  # nothing protects them: 90 days old, finished, on no alias
    assert after == {n: (0, 0) if n in gone else before[n] for n in ids}, after
    assert done == Pruned(events=sum(before[n][0] for n in gone) + 1, checks=6)  # + the old health-poll event
    with reg.engine.connect() as c:  # the versions themselves, their rollouts and the views: all still there
        assert c.execute(text("SELECT COUNT(*) FROM version_history")).scalar_one() == len(PATHS)
        assert c.execute(text("SELECT COUNT(*) FROM rollouts")).scalar_one() == len(PATHS)
        row = c.execute(text("SELECT verify_ms, rollout_count, worker_update_ms FROM version_history "
                             "WHERE version = 'plain'")).one()  # fmt: skip
        assert tuple(row) == (None, 1, None)
        left = c.execute(text("SELECT to_state FROM events WHERE rollout_id IS NULL AND checkpoint_id IS NULL"))
        assert [r[0] for r in left] == ["UNREACHABLE"]  # the recent health-poll event
    assert prune(reg, keep_days=30, batch=batch) == Pruned()  # nothing more to do


def test_nothing_younger_than_the_retention_goes(db_url: str) -> None:
    reg, ids = _history(db_url)
    before = _rows(reg, ids)
    assert prune(reg, keep_days=120) == Pruned()
    assert _rows(reg, ids) == before


def _config(tmp_path: Path, db_url: str, **database: object) -> Path:
    return make_config_file(tmp_path / "c.toml", daemon={"state_dir": str(tmp_path / "state"), "listen": ""},
                            database={"url": db_url, **database},
                            sources=[{"type": "local", "path": str(tmp_path / "ckpt")}])  # fmt: skip


def test_the_daemon_schedules_it_only_when_configured(db_url: str, tmp_path: Path) -> None:
    from daemon.service import build_daemon

    (tmp_path / "ckpt").mkdir()
    reg, _ = _history(db_url)
    for days, scheduled in ((0.0, False), (30.0, True)):
        d = build_daemon(load_config(_config(tmp_path, db_url, retention_days=days, retention_interval_s=600.0)))
        d._add_jobs()
        job = d.scheduler.get_job("history-retention")
        assert (job is not None) == scheduled
        if job is not None:
            assert job.trigger.interval.total_seconds() == 600.0
            done = d.prune_history()
            assert done is not None and done.checks == 6
        d.registry.close()


@pytest.mark.parametrize("key,value", [("retention_days", -1.0), ("retention_interval_s", 0.0)])
def test_bad_retention_settings_name_their_key(tmp_path: Path, key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"database.{key}: must be"):
        load_config(_config(tmp_path, "sqlite:///x.db", **{key: value}))


def test_delivered_webhook_deliveries_go_pending_and_undeliverable_ones_stay(registry: Registry) -> None:
    from daemon.registry import WebhookDelivery

    old, new = utcnow() - timedelta(days=40), utcnow()
    with registry.session() as s:
        for i, (state, at) in enumerate([("delivered", old), ("delivered", new), ("pending", old), ("undeliverable", old)]):
            s.add(WebhookDelivery(delivery_id=f"d{i}", host="h", webhook="ops", event="version.verified", event_id=i,
                                  payload={}, state=state, attempts=1, created_at=old, next_attempt_at=old,
                                  delivered_at=at if state == "delivered" else None))  # fmt: skip
    prune(registry, keep_days=30)
    with registry.session() as s:
        assert sorted(s.scalars(select(WebhookDelivery.delivery_id))) == ["d1", "d2", "d3"]
