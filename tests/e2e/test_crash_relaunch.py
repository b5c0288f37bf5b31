"""A managed worker that crashes is relaunched at once (daemon/controller/supervise.py), real processes.

The embedded default's shape (one managed worker, the default group) under client load, with a
long `relaunch_backoff_s` (60 s) so that waiting for it would show:

1. kill -9 of the healthy worker: the supervisor's waiter thread sees the exit at once, records
   the failure ("relaunched at once", retry_in_s 0), and launches it again with no backoff; the
   worker serves again, and /health said 503 while nothing answered;
2. a second kill before `relaunch_reset_s` is a crash loop: that one waits the backoff.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, wait_until
from support_rollout import worker_events

from bench.loadgen import LoadGen

pytestmark = pytest.mark.timeout(600)


def runtime(d: DaemonProcess) -> dict[str, Any]:
    return dict(json.loads((d.state_dir / "worker-local.json").read_text()))


def launch_failures(d: DaemonProcess) -> list[dict[str, Any]]:
    """The worker's recorded deaths: a healthy worker's is a crash (worker_crashed, not a failed launch)."""
    return [e["detail"] for e in worker_events(d.registry) if e["detail"].get("action") in ("crashed", "launch_failed")]


def test_a_crashed_worker_is_relaunched_at_once_and_a_crash_loop_waits(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = daemon_factory(
        f"sqlite:///{tmp_path / 'registry.db'}",
        daemon={"keep_workers_on_stop": False},
        checks={"enabled": ["manifest", "headers", "crc32c", "compat", "finite"]},
        extra={"rollout": {"health_poll_s": 0.5, "restart_timeout_s": 120.0, "relaunch_backoff_s": 60.0,
                           "relaunch_backoff_max_s": 120.0, "relaunch_reset_s": 600.0},
               "workers": [{"name": "local", "launch": "managed", "device": "cpu"}]},  # fmt: skip
        wait=False,
    )
    try:
        d.start(timeout=120)
        d.wait_status("tiny-seed", "deployed", timeout=120)
        url = f"http://127.0.0.1:{wait_until(lambda: runtime(d)['port'], 120, 0.1, 'launch')}"
        wait_until(lambda: httpx.get(url + "/ready", timeout=5).status_code == 200, 180, 0.2, "the worker")
        wait_until(lambda: d.get("/health").status_code == 200 or None, 60, 0.1, "/health ok")
        first = runtime(d)["pid"]
        health: list[tuple[float, int]] = []
        stop = threading.Event()

        def watch_health() -> None:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    health.append((time.time(), d.get("/health").status_code))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch_health, daemon=True)
        load = LoadGen([url], concurrency=2, max_seconds=300, request_timeout_s=120.0)
        with load:
            watcher.start()
            load.wait_requests(10, timeout=60)
            killed = time.time()
            os.kill(first, signal.SIGKILL)
            # relaunched with no backoff: back long before relaunch_backoff_s (60 s) would allow
            wait_until(lambda: runtime(d)["pid"] != first or None, 45, 0.05, "the relaunch")
            wait_until(lambda: httpx.get(url + "/ready", timeout=5).status_code == 200, 45, 0.05, "the worker back")
            back = time.time()
            load.wait_requests(10, timeout=60)
            stop.set()
            watcher.join(10)
        (crash,) = launch_failures(d)
        assert crash["retry_in_s"] == 0 and crash["action"] == "crashed", crash
        assert crash["cause"] == "the worker process was killed by signal 9 while serving", crash
        silence = load.stats.longest_silence(killed - 1.0, back + 1.0)
        during = [code for t, code in health if killed + 0.5 < t < back - 0.5]
        print(f"\nkill -9 -> serving again: {back - killed:.2f} s; longest stretch with no answer {silence:.2f} s; "
              f"/health during it: {sorted(set(during))}")  # fmt: skip
        assert 503 in [code for t, code in health if killed <= t <= back], health[-20:]
        assert d.get("/health").status_code == 200 or wait_until(lambda: d.get("/health").status_code == 200 or None,
                                                                 30, 0.1, "/health ok again")  # fmt: skip

        second = runtime(d)["pid"]
        os.kill(second, signal.SIGKILL)  # within relaunch_reset_s: a crash loop waits its backoff
        wait_until(lambda: len(launch_failures(d)) == 2 or None, 30, 0.05, "the second crash recorded")
        assert launch_failures(d)[1]["retry_in_s"] == 120.0, launch_failures(d)[1]
    finally:
        d.close()
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = int(runtime(d)["pid"])
            if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
