"""The state directory is the daemon user's alone, whatever the umask the daemon starts with.

A real daemon with a managed reference worker, started under a permissive umask (0o002: group
writable, world readable): the state directory and `<state_dir>/logs` are 0700, and the registry
(`hotswap.db` with its -wal and -shm), `daemon.json`, the lock, the control and worker tokens, the
worker's runtime file and its log are 0600. Then an install from before (everything loosened while
the daemon is stopped) is tightened at the next start, with a warning naming what was changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, make_config_file, wait_until

pytestmark = pytest.mark.timeout(600)
UMASK = 0o002


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def modes(state: Path) -> dict[str, str]:
    """Every path the daemon made under the state directory (bar the seed checkpoint) -> its mode."""
    out = {".": f"{mode(state):04o}"}
    for p in sorted(state.rglob("*")):
        rel = p.relative_to(state).as_posix()
        if not rel.startswith("seed") and not p.is_socket():
            out[rel] = f"{mode(p):04o}"
    return out


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Any]:
    state = tmp_path / "state"
    started: list[DaemonProcess] = []

    def start(d: DaemonProcess | None = None) -> DaemonProcess:
        if d is None:
            cfg = make_config_file(
                tmp_path / "config.toml",
                daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "keep_workers_on_stop": False},
                sources=[{"path": str(tmp_path / "checkpoints")}],
                checks={"enabled": ["manifest", "headers", "crc32c"]},
                workers=[{"name": "local", "launch": "managed", "device": "cpu"}],
            )
            d = DaemonProcess(tmp_path, cfg, f"sqlite:///{state / 'hotswap.db'}", tmp_path / "checkpoints", state, {})
            started.append(d)
        old = os.umask(UMASK)  # the daemon (a child) inherits it
        try:
            return d.start(timeout=120)
        finally:
            os.umask(old)

    yield start
    for d in started:
        d.close()
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        os.kill(json.loads((state / "worker-local.json").read_text())["pid"], signal.SIGKILL)


EXPECTED = {
    ".": "0700", "logs": "0700",
    "hotswap.db": "0600", "hotswap.db-wal": "0600", "hotswap.db-shm": "0600",
    "daemon.json": "0600", "daemon.lock": "0600", "control.token": "0600",
    "worker-local.token": "0600", "worker-local.json": "0600", "logs/worker-local.log": "0600",
}  # fmt: skip


def test_the_state_directory_and_every_file_in_it_are_private_whatever_the_umask(daemon, tmp_path):
    state = tmp_path / "state"
    d = daemon()
    wait_until(lambda: (state / "worker-local.json").is_file() and (state / "logs" / "worker-local.log").is_file(),
               120, what=f"the managed worker's launch (state: {sorted(p.name for p in state.iterdir())})")  # fmt: skip
    wait_until(lambda: (state / "hotswap.db-wal").exists() and (state / "hotswap.db-shm").exists(), 30,
               what="SQLite's -wal and -shm files")  # fmt: skip
    seen = modes(state)
    print("modes under umask 0o002:", seen)
    assert {k: seen.get(k) for k in EXPECTED} == EXPECTED
    # nothing in the state directory is open to group or others (0700 folders, 0600 files)
    assert [k for k, m in seen.items() if int(m, 8) & 0o077] == [], seen

    # an install from before: the daemon stopped, its state left open to other users
    d.stop()
    loosened = {".": 0o755, "logs": 0o755, "hotswap.db": 0o644, "logs/worker-local.log": 0o644,
                "daemon.lock": 0o644}  # fmt: skip
    for rel, m in loosened.items():
        os.chmod(state / rel, m)
    daemon(d)
    wait_until(lambda: "database file was open to other users" in d.log(), 30, what="the database tightened, logged")
    log = d.log()
    assert "state directory was open to other users; tightened to 0700" in log, log[-3000:]
    assert "worker log was open to other users; tightened" in log, log[-3000:]
    seen = modes(state)
    print("modes after restarting on loosened state:", seen)
    assert {k: seen[k] for k in loosened} == {k: EXPECTED[k] for k in loosened}
    assert [k for k, m in seen.items() if int(m, 8) & 0o077] == [], seen
