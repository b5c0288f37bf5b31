"""Migration 0003 runs forward on a database that already holds rows (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import inspect, text

from daemon.registry import Registry, status
from daemon.registry import queries as q

pytestmark = pytest.mark.quick

NOW = datetime(2026, 12, 1, tzinfo=UTC)
STRONG = "blake3:" + "ab" * 32


def _seed_0002(reg: Registry) -> None:
    """Rows as the previous release wrote them (8-hex digest, no hashes, no check status)."""
    with reg.engine.begin() as c:
        c.execute(
            text(
                "INSERT INTO checkpoints (version, source, uri, local_path, commit_signal, digest, "
                "status, discovered_at) VALUES ('old', 's', 'file:///old', '/old', 'manifest', "
                "'deadbeef', 'verified', :now)"
            ),
            {"now": NOW},
        )
        cid = c.execute(text("SELECT id FROM checkpoints WHERE version = 'old'")).scalar_one()
        c.execute(
            text(
                "INSERT INTO checkpoint_files (checkpoint_id, path, bytes, crc32c) "
                "VALUES (:cid, 'model.safetensors', 10, '0000abcd')"
            ),
            {"cid": cid},
        )
        for name, ok, deferred, detail in [
            ("manifest", True, False, '{"files": 2}'),
            ("compat", True, False, '{"skipped": "no serving version"}'),
            ("headroom", False, True, '{"reason": "later"}'),
            ("crc32c", False, False, '{"reason": "bad"}'),
        ]:
            c.execute(
                text(
                    "INSERT INTO checks (checkpoint_id, name, ok, deferred, detail, started_at, duration_ms) "
                    "VALUES (:cid, :n, :ok, :d, :detail, :now, 1.0)"
                ),
                {"cid": cid, "n": name, "ok": ok, "d": deferred, "detail": detail, "now": NOW},
            )


def _downgrade(reg: Registry, revision: str) -> None:
    from alembic import command

    from daemon.registry.db import alembic_config

    with reg.engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def test_0003_adds_hash_columns_and_check_status_on_an_existing_database(db_url: str):
    reg = Registry(db_url)
    try:
        reg.upgrade("0002_rollout_views")
        _seed_0002(reg)
        reg.upgrade()
        insp = inspect(reg.engine)
        assert {"hash_alg", "hash"} <= {c["name"] for c in insp.get_columns("checkpoint_files")}
        assert "status" in {c["name"] for c in insp.get_columns("checks")}
        with reg.engine.connect() as c:
            statuses = dict(c.execute(text("SELECT name, status FROM checks")).all())
            old_digest = c.execute(text("SELECT digest FROM checkpoints WHERE version = 'old'")).scalar_one()
        # a skipped check from before is "skipped", never "pass"
        assert statuses == {"manifest": "pass", "compat": "skipped", "headroom": "deferred", "crc32c": "fail"}
        assert old_digest == "deadbeef"  # kept; a new `<alg>:<hex>` digest never equals it

        with reg.session() as s:
            ckpt = status.create(
                s, version="new", source="s", uri="file:///new", local_path="/new", commit_signal="index"
            )
            assert ckpt is not None
            ckpt.digest = STRONG  # 71 characters: did not fit VARCHAR(16)
            q.replace_files(
                s, ckpt, [("model.safetensors", 10, "0000abcd")], hashes={"model.safetensors": ("blake3", "cd" * 32)}
            )
            q.add_check(
                s, ckpt.id, name="compat", ok=True, detail={"skipped": "x"}, started_at=NOW, duration_ms=0.1
            )
        with reg.session() as s:
            new = q.get_checkpoint(s, "new")
            assert new is not None and new.digest == STRONG
            assert [(f.hash_alg, f.hash) for f in new.files] == [("blake3", "cd" * 32)]
            assert [c.status for c in new.checks] == ["skipped"]
            # the views were re-created and still answer
            assert {r["version"] for r in q.history(s, newest_first=False)} == {"old", "new"}

        _downgrade(reg, "0002_rollout_views")  # and back (long digests cleared), and forward again
        reg.upgrade()
        with reg.engine.connect() as c:
            assert c.execute(text("SELECT COUNT(*) FROM version_history")).scalar_one() == 2
    finally:
        reg.close()
