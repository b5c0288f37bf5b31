"""The command line's papercuts, through the real `hotswap` command (issue 36, item 9):

- `hotswap --version` imports neither FastAPI nor SQLAlchemy, and `status` of a running daemon
  imports no FastAPI (`python -X importtime`: which modules a command pays for; measured times
  are in bench/RESULTS.md);
- `-c` before or after the command; `status` exits 3 when the daemon is not running;
- `show V | head` is quiet (no BrokenPipeError); durations are rounded (`verify ms: 16.5`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import REPO, hotswap_cli, publish_tiny, wait_until

from tests.cli.test_cli_first_hour import Daemon

pytestmark = pytest.mark.timeout(300)


def imported(*args: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules `hotswap ARGS` imports (from -X importtime), and the finished process."""
    env = {k: v for k, v in os.environ.items() if k != "HOTSWAP_CONFIG"} | {"PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "daemon.cli.main", *args], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    names = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    return names, out


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("papercuts"))

    def up() -> bool:
        assert d.proc.poll() is None, d.log()
        return httpx.get(f"http://127.0.0.1:{d.port}/livez", timeout=2).status_code == 200

    wait_until(up, 60, 0.1, "the daemon's API")
    yield d
    d.stop()


def test_version_imports_neither_fastapi_nor_sqlalchemy() -> None:
    names, out = imported("--version")
    assert out.returncode == 0 and out.stdout.startswith("hotswap "), out.stdout + out.stderr
    heavy = sorted(m for m in names if m.split(".")[0] in ("fastapi", "sqlalchemy", "alembic", "torch", "httpx"))
    assert not heavy, f"`hotswap --version` imports {heavy}"


def test_status_of_a_running_daemon_asks_it_and_imports_no_fastapi(daemon: Daemon) -> None:
    names, out = imported("status", "-c", str(daemon.config), "--state-dir", str(daemon.state))
    assert out.returncode == 0 and "daemon:      running" in out.stdout, out.stdout + out.stderr[-2000:]
    heavy = sorted(m for m in names if m.split(".")[0] in ("fastapi", "alembic", "torch", "uvicorn"))
    assert not heavy, f"`hotswap status` imports {heavy}"


def test_config_before_or_after_the_command(daemon: Daemon) -> None:
    after = hotswap_cli("history", "-c", str(daemon.config), "--state-dir", str(daemon.state), "--json")
    before = hotswap_cli("-c", str(daemon.config), "history", "--state-dir", str(daemon.state), "--json")
    assert after.returncode == before.returncode == 0, before.stderr
    assert before.stdout == after.stdout
    eq = hotswap_cli(f"--config={daemon.config}", "status", "--state-dir", str(daemon.state))
    assert eq.returncode == 0 and "daemon:      running" in eq.stdout, eq.stderr


def test_show_is_rounded_and_quiet_into_a_closed_pipe(daemon: Daemon, tmp_path: Path) -> None:
    publish_tiny(tmp_path / "ok-1", seed=1, version="ok-1")
    import shutil

    shutil.copytree(tmp_path / "ok-1", daemon.watch / "ok-1")
    args = ("-c", str(daemon.config), "--state-dir", str(daemon.state))
    wait_until(lambda: "verified" in hotswap_cli("show", "ok-1", *args).stdout, 120, 0.3, "ok-1 verified")
    out = hotswap_cli("show", "ok-1", *args)
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("verify ms:")]
    assert re.fullmatch(r"verify ms:\s+\d+\.\d", line), line
    # the reader is gone before the first line: `hotswap show ok-1 | head -0`
    env = {k: v for k, v in os.environ.items() if k != "HOTSWAP_CONFIG"} | {"PYTHONPATH": str(REPO)}
    for argv in (["show", "ok-1", *args], ["history", *args]):
        r, w = os.pipe()
        os.close(r)
        p = subprocess.run([sys.executable, "-m", "daemon.cli.main", *argv], stdout=w, stderr=subprocess.PIPE,
                           env=env, timeout=60)  # fmt: skip
        os.close(w)
        assert p.stderr == b"", p.stderr.decode()[-2000:]


def test_status_exits_3_when_the_daemon_is_not_running(tmp_path: Path) -> None:
    d = Daemon(tmp_path)
    wait_until(lambda: (d.state / "daemon.json").is_file() and hotswap_cli(
        "status", "-c", str(d.config), "--state-dir", str(d.state)).returncode == 0, 60, 0.2, "the daemon up")
    d.stop()
    out = hotswap_cli("status", "-c", str(d.config), "--state-dir", str(d.state))
    assert out.returncode == 3 and "daemon:      not running" in out.stdout, (out.returncode, out.stdout, out.stderr)
