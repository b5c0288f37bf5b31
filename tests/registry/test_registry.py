"""Registry models, migrations and views on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from conftest import hotswap_cli, make_config_file
from sqlalchemy import inspect, text

from daemon.registry import Alias, Checkpoint, Event, Registry, Rollout, Worker, status
from daemon.registry import queries as q
from daemon.registry.status import CheckpointStatus as C
from daemon.registry.status import IllegalStatusTransition


def test_migrations_create_every_table_and_view_and_are_idempotent(registry):
    registry.upgrade()  # second run is a no-op
    insp = inspect(registry.engine)
    assert set(insp.get_table_names()) >= {
        "checkpoints",
        "checkpoint_files",
        "checks",
        "workers",
        "rollouts",
        "events",
        "aliases",
    }
    assert set(insp.get_view_names()) >= {"version_history", "worker_versions"}
    assert registry.current_revision() == head_revision()
    cols = {c["name"] for c in insp.get_columns("checkpoints")}
    assert cols >= {
        "id",
        "version",
        "source",
        "uri",
        "local_path",
        "step",
        "parent",
        "digest",
        "total_bytes",
        "tensor_count",
        "status",
        "status_message",
        "discovered_at",
        "verified_at",
        "deployed_at",
    }


def test_version_is_registered_once(registry):
    with registry.session() as s:
        first = status.create(
            s, version="v1", source="t", uri="file:///a", local_path="/a", commit_signal="manifest"
        )
        again = status.create(
            s, version="v1", source="t", uri="file:///b", local_path="/b", commit_signal="marker"
        )
        assert first is not None and again is None
    with registry.session() as s:
        assert [c.local_path for c in s.query(Checkpoint)] == ["/a"]
        assert [e.to_state for e in s.query(Event)] == ["discovered"]


def test_unique_version_is_enforced_by_the_database(registry):
    # Two registrations racing past the lookup must still leave one row.
    with registry.session() as s:
        s.add(Checkpoint(version="dup", source="t", uri="u", status="discovered"))
    with pytest.raises(Exception), registry.session() as s:  # noqa: B017 - IntegrityError from either driver
        s.add(Checkpoint(version="dup", source="t", uri="u", status="discovered"))
    with registry.session() as s:
        assert s.query(Checkpoint).count() == 1


def test_statuses_are_validated_in_python(registry):
    with pytest.raises(ValueError, match="checkpoints.status='verfied' is not one of"):
        Checkpoint(version="x", source="t", uri="u", status="verfied")
    with pytest.raises(ValueError, match="rollouts.outcome"):
        Rollout(checkpoint_id=1, outcome="meh")


def test_timestamps_are_utc_aware_and_naive_ones_refused(registry):
    local = datetime.now(UTC).astimezone(__import__("zoneinfo").ZoneInfo("Asia/Tokyo"))
    with registry.session() as s:
        s.add(Checkpoint(version="tz", source="t", uri="u", status="discovered", discovered_at=local))
    with registry.session() as s:
        c = q.get_checkpoint(s, "tz")
        assert c.discovered_at.utcoffset() == timedelta(0)
        assert c.discovered_at == local
    with pytest.raises(Exception, match="naive datetime"), registry.session() as s:
        s.add(
            Checkpoint(
                version="naive", source="t", uri="u", status="discovered", discovered_at=datetime(2026, 1, 1)
            )
        )


def walk(s, ckpt, *path):
    """Move a checkpoint along `path` (each step an allowed transition)."""
    for to in path:
        status.move(s, ckpt, to)


def test_status_changes_are_events_and_history_view_answers(registry):
    with registry.session() as s:
        a = status.create(s, version="a", source="t", uri="u", local_path="/a", commit_signal="index")
        status.move(s, a, C.VERIFYING)
        q.add_check(
            s,
            a.id,
            name="crc32c",
            ok=True,
            detail={"files": 1},
            started_at=datetime.now(UTC),
            duration_ms=12.5,
        )
        q.replace_files(s, a, [("model.safetensors", 10, "0000abcd")])
        a.digest, a.total_bytes = "12345678", 10
        status.move(s, a, C.VERIFIED)
        b = status.create(
            s, version="b", source="t", uri="u", local_path="/b", commit_signal="manifest"
        )
        walk(s, b, C.VERIFYING, C.VERIFIED)
        status.move(s, b, C.SUPERSEDED, "newer version arrived")
        r = Rollout(
            checkpoint_id=a.id,
            trigger="new",
            transport="disk",
            mode="copy",
            outcome="rolled_back",
            finished_at=datetime.now(UTC),
        )
        s.add(r)
        s.add(Alias(name="serving", checkpoint_id=a.id))  # the session stamps its host
    with registry.session() as s:
        rows = {r["version"]: r for r in q.history(s)}
        events = [(e.from_state, e.to_state) for e in s.query(Event).filter(Event.checkpoint_id == 1)]
    assert events == [(None, "discovered"), ("discovered", "verifying"), ("verifying", "verified")]
    assert rows["a"]["status"] == "verified" and rows["a"]["verified_at"] is not None
    assert rows["a"]["verify_ms"] == 12.5
    assert rows["a"]["rolled_back_at"] is not None and rows["a"]["rollout_count"] == 1
    assert rows["a"]["serving"] == 1 and rows["b"]["serving"] == 0
    assert rows["b"]["superseded_at"] is not None
    assert rows["b"]["status_message"] == "newer version arrived"
    with registry.session() as s:
        assert q.status_counts(s) == {"verified": 1, "superseded": 1}
        assert [c.version for c in q.unfinished_checkpoints(s)] == []


def test_plain_sql_on_the_views(registry):
    with registry.session() as s:
        c = status.create(
            s, version="v9", source="t", uri="u", local_path="/v9", commit_signal="marker"
        )
        walk(s, c, C.VERIFYING, C.VERIFIED, C.DEPLOYED)
        s.add(
            Worker(
                name="gpu0", kind="builtin", url="http://127.0.0.1:8001", state="RUNNING", weight_version="v9"
            )
        )
    with registry.engine.connect() as conn:
        hist = conn.execute(text("SELECT version, status FROM version_history")).all()
        workers = conn.execute(
            text(
                "SELECT worker, kind, state, weight_version, version_status, updated_at, "
                "last_error FROM worker_versions"
            )
        ).all()
    assert [tuple(r) for r in hist] == [("v9", "deployed")]
    assert [tuple(r)[:5] for r in workers] == [("gpu0", "builtin", "RUNNING", "v9", "deployed")]


def test_duplicate_lookup_ignores_rejected_and_self(registry):
    with registry.session() as s:
        a = status.create(
            s, version="a", source="t", uri="u", local_path="/a", commit_signal="manifest"
        )
        a.digest = "deadbeef"
        status.move(s, a, C.VERIFYING)
        status.move(s, a, C.REJECTED, "bad")
        b = status.create(
            s, version="b", source="t", uri="u", local_path="/b", commit_signal="manifest"
        )
        b.digest = "deadbeef"
        status.move(s, b, C.VERIFYING)
        status.move(s, b, C.VERIFIED)
        c = status.create(
            s, version="c", source="t", uri="u", local_path="/c", commit_signal="manifest"
        )
        assert q.find_same_digest(s, "deadbeef", c.id).version == "b"
        assert q.find_same_digest(s, "deadbeef", b.id) is None


def test_status_moves_only_along_the_table_and_notes_keep_it(registry):
    with registry.session() as s:
        ckpt = status.create(s, version="t1", source="t", uri="u", local_path="/t", commit_signal="manifest")
        with pytest.raises(IllegalStatusTransition, match="t1: discovered -> deployed is not allowed"):
            status.move(s, ckpt, C.DEPLOYED)
        with pytest.raises(IllegalStatusTransition, match="verifying -> deployed"):
            status.move(s, ckpt, C.VERIFYING)
            status.move(s, ckpt, C.DEPLOYED)  # never without being verified first
        status.move(s, ckpt, C.VERIFIED)
        status.note(s, ckpt, "waiting for a worker")
        assert (ckpt.status, ckpt.status_message) == ("verified", "waiting for a worker")
        status.move(s, ckpt, C.DEPLOYED, "serving")
        with pytest.raises(IllegalStatusTransition):
            status.move(s, ckpt, C.VERIFYING)  # a deployed version is never verified again in place
    with registry.session() as s:
        events = [(e.from_state, e.to_state) for e in s.query(Event).order_by(Event.id)]
    assert events == [(None, "discovered"), ("discovered", "verifying"), ("verifying", "verified"),
                      ("verified", "verified"), ("verified", "deployed")]  # fmt: skip


def test_every_status_has_a_row_in_the_table_and_the_pipeline_path_is_allowed():
    assert set(status.TRANSITIONS) == set(C)
    path = [C.DISCOVERED, C.FETCHING, C.VERIFYING, C.VERIFIED, C.STAGED, C.DEPLOYED, C.RETIRED]
    for a, b in zip(path, path[1:], strict=False):
        assert b in status.TRANSITIONS[a], (a, b)
    assert status.TRANSITIONS[C.DUPLICATE] == frozenset({C.DISCOVERED})  # only looked at again, from the start
    assert C.DISCOVERED not in status.TRANSITIONS[C.DEPLOYED]  # the serving version is never re-verified in place


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    from daemon.registry.db import alembic_config

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def test_cli_db_upgrade(db_url, tmp_path):
    cfg = make_config_file(tmp_path / "c.toml", database={"url": db_url}, daemon={"state_dir": str(tmp_path)})
    out = hotswap_cli("db", "upgrade", "-c", str(cfg), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"at revision {head_revision()}" in out.stdout
    reg = Registry(db_url)
    try:
        assert "version_history" in inspect(reg.engine).get_view_names()
    finally:
        reg.close()


def test_unreachable_database_is_one_line_error(tmp_path):
    cfg = make_config_file(
        tmp_path / "c.toml",
        database={"url": "postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=2"},
    )
    out = hotswap_cli("db", "upgrade", "-c", str(cfg), cwd=tmp_path)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hotswap: error: migrating database postgresql+psycopg://")
