"""`hotswap --version`, `status` and `history` do their work in <= 0.3 s on an idle 2-core
machine (issue 36, item 9) because each imports only what it needs: that is what this test holds.

Each command runs in a fresh interpreter under `python -X importtime` against a real verify-only
daemon and its SQLite registry. What fails the test: a heavy package among the imported modules
(FastAPI, SQLAlchemy, structlog, httpx, ...), a non-zero exit, or output without the answer.
The time itself is a figure, not an assertion (tests never assert timings: on a loaded VM the
CPU time of the same command doubled and failed a 0.3 s bound that the idle machine meets
with room): bench/cli_stop.py measures wall clock and CPU time, recorded in bench/RESULTS.md.
`history` on SQLite reads with sqlite3 (daemon.cli.sqlite_read); it must read what the
registry's query reads.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import REPO, publish_tiny, wait_until

from tests.cli.test_cli_first_hour import Daemon

pytestmark = pytest.mark.timeout(300)

HEAVY = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "structlog", "httpx", "httpcore", "torch",
         "numpy", "apscheduler", "watchdog", "boto3", "psycopg", "pydantic")  # fmt: skip


def run_traced(args: list[str], out_dir: Path) -> tuple[int, set[str], str]:
    """(exit code, modules imported, stdout) of `hotswap ARGS` in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "HOTSWAP_CONFIG"} | {"PYTHONPATH": str(REPO)}
    with open(out_dir / "out", "wb") as out, open(out_dir / "err", "wb") as err:
        p = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "daemon.cli.main", *args], env=env,
                             stdout=out, stderr=err)  # fmt: skip
        p.wait()
    lines = (out_dir / "err").read_text().splitlines()
    names = {ln.rsplit("|", 1)[1].strip() for ln in lines if ln.startswith("import time:") and "|" in ln}
    return p.returncode, names, (out_dir / "out").read_text()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("cli-speed"))

    def up() -> bool:
        assert d.proc.poll() is None, d.log()
        return httpx.get(f"http://127.0.0.1:{d.port}/livez", timeout=2).status_code == 200

    wait_until(up, 60, 0.1, "the daemon's API")
    stage = tmp_path_factory.mktemp("cli-speed-stage")
    publish_tiny(stage / "fast-1", seed=1, version="fast-1")
    shutil.copytree(stage / "fast-1", d.watch / "fast-1")
    yield d
    d.stop()


@pytest.mark.parametrize("command", ["--version", "status", "history"])
def test_read_commands_import_only_what_they_need(daemon: Daemon, command: str, tmp_path: Path) -> None:
    args = [command] if command == "--version" else [command, "-c", str(daemon.config), "--state-dir",
                                                     str(daemon.state)]  # fmt: skip
    if command == "history":
        wait_until(lambda: "fast-1" in run_traced(args, tmp_path)[2], 120, 0.3, "fast-1 in history")
    code, names, out = run_traced(args, tmp_path)
    assert code == 0, out + (tmp_path / "err").read_text()[-2000:]
    assert "running" in out if command == "status" else "fast-1" in out if command == "history" else out
    heavy = sorted({m for m in names if m.split(".")[0] in HEAVY})
    assert not heavy, f"`hotswap {command}` imports {heavy[:12]}"


def test_history_reads_from_sqlite_what_the_registry_reads(tmp_path: Path) -> None:
    """Four hosts on one SQLite file (each its own copy and aliases): sqlite3's rows equal
    `queries.history`'s for each host, whole, paged and by adapter; an older schema goes to the registry."""
    from support_fleet import HOSTS, Fleet

    from daemon.cli.sqlite_read import history_rows
    from daemon.registry import Registry
    from daemon.registry import queries as q

    url = f"sqlite:///{tmp_path / 'hotswap.db'}"
    fleet = Fleet(url, tmp_path / "ckpts")
    fleet.on("host-1", "v1")
    fleet.close()
    for host in (*HOSTS, ""):  # "": no [fleet] host (the one host of a single-host database, or this machine)
        reg = Registry(url, host or None)
        for limit, adapter in ((None, None), (2, None), (None, "sql")):
            with reg.session() as s:
                want = q.history(s, limit=limit, adapter=adapter)
            got = history_rows(url, host, limit, adapter)
            assert got == want, (host, limit, adapter)
        reg.close()
    assert any(r["serving"] for r in history_rows(url, "host-1", None, None) or [])
    with sqlite3.connect(tmp_path / "hotswap.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0001_initial'")
    conn.close()
    assert history_rows(url, "host-1", None, None) is None  # older: the registry migrates it
    assert history_rows(f"sqlite:///{tmp_path / 'none.db'}", "", None, None) is None  # not there: it says so
    assert history_rows("postgresql+psycopg://u@127.0.0.1/db", "", None, None) is None


def test_history_from_sqlite_reads_one_moment_while_the_daemon_writes(tmp_path: Path) -> None:
    """v1 begins to serve (alias, statuses) between the reader's statements: every row still says
    what held at one moment, not v1 `verified` and serving beside v0 `deployed` and not."""
    from support_fleet import seed_versions

    from daemon.cli.sqlite_read import newest_revision, read
    from daemon.registry import Registry
    from daemon.registry.journal import Journal
    from daemon.registry.status import CheckpointStatus as C

    url = f"sqlite:///{tmp_path / 'hotswap.db'}"
    reg = Registry(url, "host-a")
    reg.upgrade()
    ids = seed_versions(reg, tmp_path / "ckpts", {"v0": C.DEPLOYED, "v1": C.VERIFIED})
    j = Journal(reg)
    j.set_alias("serving", ids["v0"])
    moved: list[str] = []

    def between(sql: str) -> None:  # as the reader's `serving` statement starts
        if "FROM aliases WHERE host" in sql and not moved:
            moved.append(sql)
            j.set_alias("serving", ids["v1"])
            j.move_statuses([(ids["v1"], C.DEPLOYED, None), (ids["v0"], C.RETIRED, None)])

    with sqlite3.connect(f"{(tmp_path / 'hotswap.db').as_uri()}?mode=ro", uri=True) as conn:
        conn.set_trace_callback(between)
        rows = read(conn, "host-a", None, None, newest_revision(REPO / "migrations"))
    conn.close()
    reg.close()
    assert moved and rows is not None
    seen = {r["version"]: (r["status"], r["serving"]) for r in rows}
    assert seen in ({"v0": ("deployed", 1), "v1": ("verified", 0)},
                    {"v0": ("retired", 0), "v1": ("deployed", 1)}), seen  # fmt: skip
