"""The state directory's disk full (issue 21's fault matrix), with real processes: the quickstart's
shape (one managed worker, SQLite in the state folder, the worker's log there too) on a 64 MB
tmpfs. Filling it is a critical problem in /health (it was green: `SELECT 1` still answers). The
disk stays full while a checkpoint arrives (the daemon logs its discovery) and the worker answers
completions all the while; the checkpoint is deployed once there is room again, nothing lost."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import DaemonProcess, publish_tiny, wait_until
from support_managed import close_managed, managed_daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root)")


@pytest.fixture
def on_tmpfs(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(state)], check=True)
    try:
        yield tmp_path
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def worker_url(d: DaemonProcess) -> str:
    """The managed worker's serving URL (its runtime file in the state folder)."""
    return f"http://127.0.0.1:{json.loads((d.state_dir / 'worker-local.json').read_text())['port']}"


def test_a_full_state_disk_is_critical_and_a_checkpoint_committed_meanwhile_is_deployed_after(on_tmpfs: Path) -> None:
    started: list[DaemonProcess] = []
    try:
        d = managed_daemon(on_tmpfs, started)
        wait_until(lambda: d.get("/health").status_code == 200, 120, 0.2, "the quickstart serving")
        fill = d.state_dir / "fill"
        subprocess.run(["dd", "if=/dev/zero", f"of={fill}", "bs=1M"], capture_output=True)
        try:
            wait_until(lambda: "state_disk_full" in d.get("/health").text, 30, 0.2, "/health: state_disk_full")
            assert d.get("/health").status_code == 503
            assert d.get("/livez").status_code == 200  # the process itself works
            publish_tiny(d.watch_dir / "full-v2", seed=2)
            # held full until the daemon has met the checkpoint (its log is outside the tmpfs): its
            # registration refused by the full disk (retried), or recorded all the same
            wait_until(lambda: any('"full-v2"' in line and ("recording a discovered checkpoint failed" in line
                                                            or '"discovered"' in line) for line in d.log().splitlines()),
                       120, 0.2, "the daemon to meet full-v2 on a full disk")  # fmt: skip
            with httpx.Client(base_url=worker_url(d), timeout=30) as c:
                for i in range(10):  # the worker keeps serving, the disk still full
                    r = c.post("/v1/completions", json={"prompt": f"still serving {i}", "max_tokens": 2})
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"], r.text
            assert os.statvfs(d.state_dir).f_bavail * os.statvfs(d.state_dir).f_frsize < 1 << 20  # still full
            assert "state_disk_full" in d.get("/health").text
        finally:
            fill.unlink(missing_ok=True)
        d.wait_status("full-v2", "deployed", timeout=180)
        wait_until(lambda: d.get("/health").status_code == 200, 60, 0.2, "/health ok with room again")
    finally:
        for p in started:
            close_managed(p)
