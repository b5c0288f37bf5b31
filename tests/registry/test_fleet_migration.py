"""Migration 0005_fleet_hosts forwards a single-host database with data (SQLite and PostgreSQL),
and fleet mode on SQLite is refused at start with one line (exit 2)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from conftest import REPO, make_config_file
from sqlalchemy import text

from daemon.config import ConfigError, parse_config
from daemon.fleet.target import fleet_rows
from daemon.registry import Registry
from daemon.registry import queries as q
from daemon.registry.db import alembic_config
from daemon.registry.journal import Journal

pytestmark = pytest.mark.quick

T0 = "2026-11-30 10:00:00"


def _seed_0004(reg: Registry) -> None:
    """Rows as a single-host daemon at revision 0004 wrote them (a deployed version was verified first)."""
    with reg.engine.begin() as c:
        for i, v in ((1, "v0"), (2, "v1")):
            c.execute(text(
                "INSERT INTO checkpoints (id, version, source, uri, local_path, status, discovered_at, verified_at, "
                "deployed_at) VALUES (:i, :v, 'local:/ck', :u, :p, :st, :t, :t, :t)"
            ), {"i": i, "v": v, "u": f"file:///ck/{v}", "p": f"/ck/{v}", "st": "retired" if i == 1 else "deployed",
                "t": T0})  # fmt: skip
        c.execute(text("INSERT INTO workers (name, kind, url, device, state, weight_version, updated_at) "
                       "VALUES ('w0', 'builtin', 'http://127.0.0.1:9', 'cpu', 'RUNNING', 'v1', :t)"), {"t": T0})  # fmt: skip
        for name, ck in (("serving", 2), ("last_good", 2)):
            c.execute(text("INSERT INTO aliases (name, checkpoint_id, updated_at) VALUES (:n, :c, :t)"),
                      {"n": name, "c": ck, "t": T0})  # fmt: skip
        c.execute(text("INSERT INTO rollouts (id, checkpoint_id, trigger, transport, mode, started_at, finished_at, "
                       "outcome) VALUES (1, 2, 'new', 'disk', 'copy', :t, :t, 'succeeded')"), {"t": T0})  # fmt: skip
        c.execute(text("INSERT INTO events (at, rollout_id, worker, from_state, to_state) "
                       "VALUES (:t, 1, 'w0', 'RUNNING', 'UPDATED')"), {"t": T0})  # fmt: skip


def test_0005_forwards_a_single_host_database_with_its_data(db_url: str) -> None:
    reg = Registry(db_url, "gpu-07")
    reg.upgrade("0004_firsthour_last_deployed")
    _seed_0004(reg)
    reg.upgrade()
    assert reg.current_revision() == ScriptDirectory.from_config(alembic_config()).get_current_head()
    with reg.engine.connect() as c:
        for table in ("workers", "aliases", "rollouts", "events"):
            assert c.execute(text(f"SELECT DISTINCT host FROM {table}")).scalars().all() == ["gpu-07"], table
        locs = c.execute(text("SELECT checkpoint_id, host, local_path FROM checkpoint_locations ORDER BY 1")).all()
        assert [tuple(r) for r in locs] == [(1, "gpu-07", "/ck/v0"), (2, "gpu-07", "/ck/v1")]
        fleet = c.execute(text("SELECT host, serving, last_good, workers, workers_running, lag FROM fleet_versions"))
        assert [tuple(r) for r in fleet] == [("gpu-07", "v1", "v1", 1, 1, 0)]
    # the host-bound API reads the migrated rows as this host's, and checkpoints.local_path stays
    j = Journal(reg)
    assert j.alias("serving").version == "v1"  # type: ignore[union-attr]
    assert j.checkpoint_by_version("v1").local_path == "/ck/v1"  # type: ignore[union-attr]
    assert j.worker_state("w0") == ("RUNNING", "v1")
    with reg.session() as s:
        assert q.aliases(s) == {"serving": "v1", "last_good": "v1", "pinned": None}
        rows = {r["version"]: r for r in q.history(s)}
        assert rows["v1"]["serving"] == 1 and rows["v1"]["local_path"] == "/ck/v1"
    doc = fleet_rows(reg)  # `hotswap status --fleet`: the worker was last polled long ago
    assert doc["target"] == "v1" and not doc["target_explicit"]
    assert [(h["host"], h["serving"], h["last_good"], h["state"]) for h in doc["hosts"]] == [
        ("gpu-07", "v1", "v1", "silent")]  # fmt: skip
    # another host on the same database sees none of it as its own
    other = Registry(db_url, "gpu-08")
    assert Journal(other).alias("serving") is None
    assert Journal(other).checkpoint_by_version("v1").local_path is None  # type: ignore[union-attr]
    other.close()
    reg.close()


def test_without_a_host_setting_sqlite_keeps_the_host_its_rows_have(db_url: str) -> None:
    """A container gets a new hostname with every new container: on SQLite (one machine's file)
    the rows' single host is kept; on PostgreSQL (a fleet's) the hostname is the host."""
    first = Registry(db_url, "old-container")
    first.upgrade()
    Journal(first).register_workers([("w0", "builtin", "http://127.0.0.1:9", "cpu")])
    first.close()
    again = Registry(db_url)
    again.upgrade()
    if again.dialect == "sqlite":
        assert again.host == "old-container" and Journal(again).worker_state("w0") == ("UNKNOWN", None)
    else:
        assert again.host == socket.gethostname()
    again.close()


def test_fleet_mode_on_sqlite_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fleet mode needs a PostgreSQL registry"):
        parse_config({"fleet": {"enabled": True}}, "x.toml")
    parse_config({"fleet": {"host": "gpu-07"}}, "x.toml")  # a host name alone is fine on SQLite
    cfg = make_config_file(tmp_path / "config.toml", daemon={"state_dir": str(tmp_path / "state"), "listen": ""},
                           fleet={"enabled": True, "max_updating_hosts": 1})  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "daemon.cli.main", "daemon", "-c", str(cfg)], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "fleet mode needs a PostgreSQL registry" in lines[0] and str(cfg) in lines[0], out.stderr
    assert not (tmp_path / "state" / "hotswap.db").exists()  # refused before anything was created


def test_bad_fleet_values_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"fleet\.max_updating_hosts: must be >= 1"):
        parse_config({"fleet": {"max_updating_hosts": 0}}, "x.toml")
    with pytest.raises(ConfigError, match=r"fleet\.host"):
        parse_config({"fleet": {"host": "two words"}}, "x.toml")


def test_0008_to_0010_remember_every_current_last_good_and_go_back_down(db_url: str) -> None:
    reg = Registry(db_url, "gpu-07")
    reg.upgrade("0007_events_state_index")
    with reg.engine.begin() as c:
        for i, v in ((1, "v0"), (2, "v1")):
            c.execute(text("INSERT INTO checkpoints (id, version, source, uri, status, discovered_at, verified_at) "
                           "VALUES (:i, :v, 'local:/ck', :u, 'retired', :t, :t)"), {"i": i, "v": v, "u": f"file:///ck/{v}", "t": T0})  # fmt: skip
        for host, name, ck in (("gpu-07", "serving", 1), ("gpu-07", "last_good", 1), ("gpu-08", "last_good", 2)):
            c.execute(text("INSERT INTO aliases (host, name, checkpoint_id, updated_at) VALUES (:h, :n, :c, :t)"),
                      {"h": host, "n": name, "c": ck, "t": T0})  # fmt: skip
        c.execute(text("INSERT INTO checkpoints (id, version, source, uri, status, discovered_at) "
                       "VALUES (3, 'v2', 'local:/ck', 'file:///ck/v2', 'verified', :t)"), {"t": T0})  # fmt: skip
    reg.upgrade()
    with reg.engine.connect() as c:
        rows = c.execute(text("SELECT version, last_good_at IS NOT NULL FROM checkpoints ORDER BY id")).all()
        fleet = c.execute(text("SELECT host, serving, target, lag FROM fleet_versions ORDER BY host")).all()
    assert [tuple(r) for r in rows] == [("v0", True), ("v1", True), ("v2", False)]
    assert [tuple(r) for r in fleet] == [("gpu-07", "v0", "v1", 1), ("gpu-08", None, "v1", 2)]
    from alembic import command

    with reg.engine.begin() as conn:  # additive: down again drops the column, the table, the new view
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0007_events_state_index")
    assert reg.current_revision() == "0007_events_state_index"
    with reg.engine.connect() as c:
        assert c.execute(text("SELECT COUNT(*) FROM checkpoints")).scalar_one() == 3
        assert [tuple(r) for r in c.execute(text("SELECT host, lag FROM fleet_versions ORDER BY host"))] == [
            ("gpu-07", 0), ("gpu-08", 0)]  # 0005's lag: no succeeded rollouts
    reg.close()
