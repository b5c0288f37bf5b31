"""Migrations run one at a time per database: processes started together on one fresh database
all migrate it (issue: two daemons started at once on a fresh PostgreSQL database, one died with
`duplicate key value violates unique constraint "pg_type_typname_nsp_index"` creating
alembic_version; parallel `hotswap db upgrade` runs failed 4 of 5).

Every process here is real. Each waits at a start gate (a file the test creates once all of
them are waiting, after their imports), so their migrations overlap however slowly the machine
starts Python: without the lock at least one of five fails on a fresh database.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BACKENDS, POSTGRES_ENV, REPO, _postgres_database, make_config_file, wait_until
from sqlalchemy import inspect

from daemon.registry import Registry

PROCESSES = 5
ROUNDS = 3

# `hotswap db upgrade` (the CLI's own main) or `alembic` (Alembic's own, through migrations/env.py)
# in a process that first imports what the migration needs, says it is waiting
# (GATE.<pid>.waiting) and starts only once GATE exists.
GATED = """\
import os, sys, time
import alembic.command, alembic.config, alembic.runtime.migration, sqlalchemy, daemon.registry.db
import daemon.registry.models
from daemon.cli.main import main
gate, which = sys.argv.pop(1), sys.argv.pop(1)
open(f"{gate}.{os.getpid()}.waiting", "w").close()
while not os.path.exists(gate):
    time.sleep(0.005)
if which == "alembic":
    alembic.config.main(argv=sys.argv[1:], prog="alembic")
    sys.exit(0)
sys.exit(main(sys.argv[1:]))
"""


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    from daemon.registry.db import alembic_config

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


@pytest.fixture(params=BACKENDS)
def fresh_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """A factory of fresh, empty databases on the backend (each PostgreSQL one dropped at the end)."""
    with contextlib.ExitStack() as stack:
        made: list[str] = []

        def make() -> str:
            if request.param == "sqlite":
                url = f"sqlite:///{tmp_path / f'fresh{len(made)}' / 'registry.db'}"
            else:
                url = stack.enter_context(contextlib.contextmanager(_postgres_database)(os.environ[POSTGRES_ENV]))
            made.append(url)
            return url

        yield make


def _open_gate(gate: Path, procs: list[subprocess.Popen[str]]) -> None:
    def all_waiting() -> bool:
        for p in procs:
            if p.poll() is not None:
                out, err = p.communicate()
                raise AssertionError(f"pid {p.pid} exited with {p.returncode} before the gate:\n{out}\n{err}")
        return len(list(gate.parent.glob(f"{gate.name}.*.waiting"))) == len(procs)

    wait_until(all_waiting, 180, 0.05, f"{len(procs)} processes at the start gate")
    gate.touch()


def _schema_at_head(url: str) -> tuple[str | None, list[str], list[str]]:
    reg = Registry(url)
    try:
        insp = inspect(reg.engine)
        return reg.current_revision(), sorted(insp.get_table_names()), sorted(insp.get_view_names())
    finally:
        reg.close()


def _run_together(work: Path, which: str, args: list[str]) -> list[tuple[int, int, str, str]]:
    """PROCESSES gated processes of `which` with `args`, released at once: (pid, rc, stdout, stderr) each."""
    env = {k: v for k, v in os.environ.items() if k != "HOTSWAP_CONFIG"}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    gate = work / "gate"
    procs = [
        subprocess.Popen([sys.executable, "-c", GATED, str(gate), which, *args], cwd=work, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(PROCESSES)
    ]  # fmt: skip
    try:
        _open_gate(gate, procs)
        return [(p.pid, p.wait(180), *p.communicate()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _assert_all_migrated(results: list[tuple[int, int, str, str]], url: str, what: str) -> None:
    failed = [r for r in results if r[1] != 0]
    assert failed == [], f"{what}: {len(failed)} of {PROCESSES} failed:\n" + "\n".join(
        f"pid {pid} rc={rc}\nstdout: {out}\nstderr: {err}" for pid, rc, out, err in failed
    )
    revision, tables, views = _schema_at_head(url)
    assert revision == head_revision(), what
    assert {"alembic_version", "checkpoints", "events", "rollouts", "workers"} <= set(tables), tables
    assert "version_history" in views, views


def test_five_db_upgrades_started_together_all_succeed(fresh_db: Callable[[], str], tmp_path: Path) -> None:
    for n in range(ROUNDS):
        url = fresh_db()
        work = tmp_path / f"round{n}"
        work.mkdir()
        cfg = make_config_file(work / "c.toml", daemon={"state_dir": str(work / "state")}, database={"url": url})
        results = _run_together(work, "hotswap", ["db", "upgrade", "-c", str(cfg)])
        _assert_all_migrated(results, url, f"round {n}: `hotswap db upgrade`")
        assert all(f"at revision {head_revision()}" in out for _, _, out, _ in results), results


def test_five_alembic_upgrades_by_hand_started_together_all_succeed(fresh_db: Callable[[], str], tmp_path: Path) -> None:
    # `alembic upgrade head` from the repository goes through migrations/env.py, which takes the same lock
    url = fresh_db()
    results = _run_together(tmp_path, "alembic", ["-c", str(REPO / "alembic.ini"), "-x", f"url={url}", "upgrade", "head"])
    _assert_all_migrated(results, url, "`alembic upgrade head`")


def _poll(fn: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait for `fn()`; an exception it raises (a process died) fails at once, unlike wait_until."""
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


@pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"{POSTGRES_ENV} is not set")
def test_five_daemons_started_together_on_a_fresh_postgres_database_all_become_healthy(
    daemon_factory: Callable[..., Any], tmp_path: Path
) -> None:
    gate = tmp_path / "start-gate"
    with contextlib.contextmanager(_postgres_database)(os.environ[POSTGRES_ENV]) as url:
        daemons = [
            daemon_factory(
                url,
                checks={"enabled": ["manifest", "headers", "crc32c"]},
                extra={"fleet": {"host": f"host-{i}"}},  # five hosts on one registry; no [[workers]]: verify only
                env={"HOTSWAP_TEST_START_GATE": str(gate)},
                hooked=True,
                wait=False,
            )
            for i in range(PROCESSES)
        ]
        try:
            for d in daemons:
                d.launch()

            def none_died() -> None:
                dead = [f"daemon{i} (host-{i}) exited with {d.proc.returncode}:\n{d.log()[-3000:]}"
                        for i, d in enumerate(daemons) if not d.alive()]  # fmt: skip
                assert not dead, f"{len(dead)} of {PROCESSES} daemons died:\n" + "\n".join(dead)

            def at_gate() -> bool:
                none_died()
                return len(list(tmp_path.glob(f"{gate.name}.*.waiting"))) == PROCESSES

            def all_started() -> bool:
                none_died()
                return all((d.state_dir / "daemon.json").is_file() for d in daemons)

            _poll(at_gate, 240, f"{PROCESSES} daemons at the start gate")
            gate.touch()
            _poll(all_started, 240, f"{PROCESSES} daemons to migrate and write daemon.json")
            for i, d in enumerate(daemons):
                d.wait_started(30)
                try:
                    wait_until(lambda d=d: d.get("/health").status_code == 200, 120, 0.1, f"daemon{i} /health 200")
                except AssertionError as exc:
                    raise AssertionError(f"{exc}: {d.get('/health').text}\n{d.log()[-3000:]}") from None
            assert _schema_at_head(url)[0] == head_revision()
            codes = [d.stop(timeout=60) for d in daemons]
            assert codes == [0] * PROCESSES, [(c, d.log()[-2000:]) for c, d in zip(codes, daemons, strict=True) if c]
        finally:
            for d in daemons:
                d.close()  # every process and registry handle, before the database is dropped
