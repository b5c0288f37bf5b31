"""A registry that cannot take writes (issue 21's fault matrix: the SQLite file made read-only, the
state disk full, PostgreSQL stopped mid-rollout): what already happened is kept, in order and with
its time, visible in /health as `database_unwritable`, and recorded once the database takes writes.
The file is made read-only with `chattr +i` (root ignores file modes; ext4 refuses writes through
descriptors opened before). The loader dying mid-stage is the fleet's fault, not the checkpoint's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from daemon.handoff.loader_client import LoaderClient
from daemon.process.storage import storage_problems
from daemon.registry import Registry
from daemon.registry.journal import Journal
from daemon.registry.models import Event
from daemon.transport.base import Expect, Outgoing, SenderOptions, StageError
from daemon.transport.ipc_stage import IpcSender

pytestmark = pytest.mark.skipif(shutil.which("chattr") is None, reason="needs chattr (e2fsprogs)")


def _immutable(paths: list[Path], on: bool) -> None:
    for p in paths:
        if p.exists():
            subprocess.run(["chattr", "+i" if on else "-i", str(p)], check=True)


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Registry]:
    r = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    r.upgrade()
    Journal(r).register_workers([("w0", "builtin", "http://w0", "cpu")])
    yield r
    _immutable([tmp_path / n for n in ("r.db", "r.db-wal", "r.db-shm")], False)
    r.close()


def test_transitions_the_database_refuses_are_kept_shown_and_recorded_in_order_later(reg: Registry, tmp_path: Path) -> None:
    files = [tmp_path / n for n in ("r.db", "r.db-wal")]
    if subprocess.run(["chattr", "+i", str(files[0])], capture_output=True).returncode != 0:
        pytest.skip("this filesystem has no immutable flag")
    _immutable(files, True)
    j = Journal(reg)
    # a worker's next step is never held up by the registry: each call returns at once
    j.transition(rollout_id=None, worker="w0", from_state="RUNNING", to_state="DRAINING", duration_ms=1.0)
    j.transition(rollout_id=None, worker="w0", from_state="DRAINING", to_state="RUNNING", duration_ms=1.0)
    assert reg.outbox.pending() == 2
    problems = storage_problems(reg, tmp_path)
    assert [p.kind for p in problems] == ["database_unwritable"] and problems[0].critical
    assert "2 writes kept" in problems[0].reason
    _immutable(files, False)
    assert reg.outbox.flush() and reg.outbox.pending() == 0
    with reg.session() as s:
        rows = s.execute(select(Event.to_state, Event.at).where(Event.worker == "w0").order_by(Event.id)).all()
    assert [r.to_state for r in rows] == ["DRAINING", "RUNNING"] and rows[0].at <= rows[1].at
    assert j.worker_state("w0")[0] == "RUNNING"
    assert storage_problems(reg, tmp_path) == []


def test_an_sqlite_file_that_cannot_be_opened_for_writing_is_a_problem_before_any_write(reg: Registry, tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    if subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem has no immutable flag")
    found = storage_problems(reg, tmp_path)
    assert [p.kind for p in found] == ["database_unwritable"] and str(db) in found[0].reason
    _immutable([db], False)
    assert storage_problems(reg, tmp_path) == []


def test_a_loader_that_does_not_answer_fails_staging_as_the_fleets_fault(tmp_path: Path) -> None:
    ckpt = tmp_path / "v1"
    ckpt.mkdir()
    sender = IpcSender(SenderOptions(tmp_path, "copy", 2.0, 2.0, str(tmp_path / "gone.sock")))
    assert isinstance(sender.loader, LoaderClient)
    with pytest.raises(StageError) as info:
        sender.prepare(Outgoing("v1", str(ckpt), Expect(digest=None, tensors=None, files=())))
    assert info.value.infra, info.value


_READER = """
import sqlite3, sys
c = sqlite3.connect(sys.argv[1])
print(c.execute("SELECT count(*) FROM workers").fetchone()[0])
c.close()
"""


def test_the_writability_probe_never_drops_the_daemons_sqlite_locks(reg: Registry, tmp_path: Path) -> None:
    """/health's probe once opened and closed the database file in the daemon's process, which drops
    every POSIX lock its SQLite connections hold on it: the next CLI to close its connection took
    itself for the last one and deleted the WAL, and the daemon's later writes went nowhere (CI:
    a checkpoint logged verified, never seen by `hotswap status` or the tests)."""
    db = tmp_path / "r.db"
    j = Journal(reg)
    with reg.engine.connect() as held:  # the daemon's connections stay open across the probe
        held.exec_driver_sql("SELECT count(*) FROM workers").all()
        for _ in range(3):
            assert storage_problems(reg, tmp_path) == []
        seen = subprocess.run([sys.executable, "-c", _READER, str(db)], capture_output=True, text=True, check=True)
        assert seen.stdout.split() == ["1"]
        assert db.with_name("r.db-wal").exists(), "another process's close deleted the WAL under a live connection"
        j.register_workers([("w0", "builtin", "http://w0", "cpu"), ("w1", "builtin", "http://w1", "cpu")])
        seen = subprocess.run([sys.executable, "-c", _READER, str(db)], capture_output=True, text=True, check=True)
        assert seen.stdout.split() == ["2"], "a write after the probe is not visible to another process"
