"""A one-worker group's restart rollout with no outage (daemon/rollout/relaunch.py, the handover), real processes.

The embedded default's shape: one managed reference worker, the default group (pause mode), under
client load. A checkpoint with a resized vocabulary (256 -> 320) needs a restart rollout:

1. with room for a second worker (this host has it), the new process starts beside the old one on
   the same listening socket; the old one keeps answering while the new one loads (requests are
   answered by the old version after the new process exists), then the new one's admin socket
   takes over and the old one stops: 0 failed requests, the worker's event says "beside";
2. with `restart_overlap = "off"` the old process must stop first, and the event and the log say why.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from conftest import DaemonProcess, wait_until
from support_engines import publish_ckpt
from support_rollout import rollouts, worker_events

from bench.loadgen import LoadGen
from daemon.common.identity import socket_dir
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(900)


def runtime(d: DaemonProcess) -> dict[str, Any]:
    return dict(json.loads((d.state_dir / "worker-local.json").read_text()))


def start(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess], **rollout: Any) -> tuple[DaemonProcess, str]:
    d = daemon_factory(
        f"sqlite:///{tmp_path / 'registry.db'}",
        daemon={"keep_workers_on_stop": False},
        checks={"enabled": ["manifest", "headers", "crc32c", "compat", "finite"]},
        extra={"rollout": {"health_window_s": 0.5, "health_poll_s": 0.5, "restart_timeout_s": 120.0, **rollout},
               "workers": [{"name": "local", "launch": "managed", "device": "cpu"}]},  # fmt: skip
        wait=False,
    )
    d.start(timeout=120)
    d.wait_status("tiny-seed", "deployed", timeout=120)
    url = f"http://127.0.0.1:{wait_until(lambda: runtime(d)['port'], 120, 0.1, 'launch')}"
    wait_until(lambda: httpx.get(url + "/ready", timeout=5).status_code == 200, 180, 0.2, "the worker")
    return d, url


def kill_worker(d: DaemonProcess) -> None:
    with contextlib.suppress(OSError, ValueError, KeyError):
        pid = int(runtime(d)["pid"])
        if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)


def vocab320(d: Path) -> Path:
    return make_tiny_checkpoint(d, seed=5, config_overrides={"vocab_size": 320})


def test_a_lone_workers_restart_rollout_starts_the_new_process_beside_the_old_one_and_fails_nothing(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d, url = start(tmp_path, daemon_factory)
    try:
        before = runtime(d)
        load = LoadGen([url], concurrency=2, max_seconds=500)
        with load:
            load.wait_requests(10, timeout=120)
            publish_ckpt(d.watch_dir, "vocab-320", vocab320)
            row = d.wait_status("vocab-320", ("deployed", "rejected"), timeout=300)
            load.wait_requests(10, timeout=120)
        assert row["status"] == "deployed", row["status_message"]
        assert load.stats.failed == 0, load.stats.errors[:5]
        r = next(r for r in rollouts(d.registry) if r["version"] == "vocab-320")
        events = worker_events(d.registry, r["id"])
        assert [(e["from"], e["to"]) for e in events] == [("RUNNING", "PAUSED"), ("PAUSED", "UPDATED"),
                                                          ("UPDATED", "RUNNING")], events  # fmt: skip
        paused = events[0]["detail"]
        assert paused["mode"] == "beside" and paused["old_pid"] == before["pid"], paused
        now = runtime(d)
        assert now["port"] == before["port"] and now["pid"] == paused["pid"] != before["pid"]
        assert not psutil.pid_exists(before["pid"]) or psutil.Process(before["pid"]).status() == psutil.STATUS_ZOMBIE
        # the overlap itself: the old version went on answering after the new process existed
        born = psutil.Process(now["pid"]).create_time()
        late_old = [a for a in load.stats.answered if a[2] == "tiny-seed" and a[0] > born]
        assert late_old, f"no request sent after the new process started was answered by the old one: {born}"
        # the new process's admin socket took the worker's path (the post-check reached it); none left over
        run = socket_dir(d.state_dir)
        assert (run / "worker-local.sock").is_socket() and not (run / "worker-local.next.sock").exists()
    finally:
        d.close()
        kill_worker(d)


def test_without_overlap_the_old_process_stops_first_and_the_event_says_why(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d, url = start(tmp_path, daemon_factory, restart_overlap="off")
    try:
        publish_ckpt(d.watch_dir, "vocab-320", vocab320)
        row = d.wait_status("vocab-320", ("deployed", "rejected"), timeout=300)
        assert row["status"] == "deployed", row["status_message"]
        r = next(r for r in rollouts(d.registry) if r["version"] == "vocab-320")
        paused = worker_events(d.registry, r["id"])[0]["detail"]
        assert paused["mode"] == "pause" and paused["stop_first"] == '[rollout] restart_overlap = "off"', paused
        assert "restart_rollout_stop_first" in d.log()
    finally:
        d.close()
        kill_worker(d)
