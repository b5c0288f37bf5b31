"""`GET /ready`, the host's readiness for load balancers, with real processes (issue 36, item 6):
200 while a worker of every group serves, whatever a source says (an S3 source that cannot
list makes `/health` 503, rightly, for alerting); 503 while the only worker is dead."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, wait_until
from support_managed import close_managed, managed_daemon

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[DaemonProcess]]:
    out: list[DaemonProcess] = []
    yield out
    for d in out:
        close_managed(d)


def test_ready_is_200_while_a_worker_serves_whatever_a_source_says(tmp_path: Path, started: Any) -> None:
    failing = {"type": "s3", "name": "bucket", "bucket": "ckpts", "prefix": "run/", "poll_interval_s": 0.5,
               "endpoint_url": "http://127.0.0.1:9", "cache_dir": str(tmp_path / "s3cache")}  # nothing listens there
    d = managed_daemon(tmp_path, started, None, [{"path": str(tmp_path / "checkpoints")}, failing])
    wait_until(lambda: d.get("/ready").status_code == 200, 180, 0.2, "the host serving")
    health = wait_until(lambda: (r := d.get("/health")).status_code == 503 and r.json(), 60, 0.2,
                        "the failing source in /health")  # fmt: skip
    assert any(p["kind"] == "source_failing" for p in health["problems"]), health
    ready = d.get("/ready")
    assert ready.status_code == 200 and ready.json() == {"ready": True, "groups": {"default": ["local"]}}, ready.text

    pid = json.loads((d.state_dir / "worker-local.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)  # nothing serves until the relaunch
    gone = wait_until(lambda: (r := d.get("/ready")).status_code == 503 and r.json(), 30, 0.02, "/ready 503")
    assert gone["ready"] is False and "no worker of group 'default' serves" in gone["error"], gone
    wait_until(lambda: d.get("/ready").status_code == 200, 180, 0.2, "the host serving again")
    assert d.get("/health").status_code == 503  # the source still fails: alerting still says so
