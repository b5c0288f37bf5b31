"""The embedded default's lone managed worker, left PAUSED by a daemon SIGKILLed inside its update:
the next daemon adopts it and puts it back in rotation at once (daemon/controller/supervise.py).

The fault matrix (bench/fault_matrix.py, rig `default`) measured 194 s without a serving worker
here: the supervisor waited `restart_timeout_s` (180 s) for an adopted worker to report RUNNING,
and nothing resumed a paused one meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
from conftest import DaemonProcess, wait_until
from support_rollout import publish_into, worker_events


def test_a_worker_left_paused_by_a_killed_daemon_serves_again_without_waiting_for_a_relaunch(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = daemon_factory(
        f"sqlite:///{tmp_path / 'hotswap.db'}",
        extra={"rollout": {"health_window_s": 0.3, "health_poll_s": 0.5, "mode": "pause"},
               "workers": [{"name": "local", "launch": "managed", "device": "cpu"}]},
        env={"HOTSWAP_TEST_HOLD_STATE": "PAUSED", "HOTSWAP_TEST_HOLD_WORKER": "local",
             "HOTSWAP_TEST_HOLD_VERSION": "v1"},
        hooked=True,
    )  # fmt: skip
    runtime_file = d.state_dir / "worker-local.json"
    try:
        d.wait_status("tiny-seed", "deployed", timeout=120)
        runtime = wait_until(lambda: json.loads(runtime_file.read_text()), 60, what="the launch")
        url = f"http://127.0.0.1:{runtime['port']}"

        def serves() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=3)
                return r.status_code == 200
            return False

        wait_until(serves, 180, what="the seed serving")
        publish_into(d.watch_dir, "v1", seed=1)
        wait_until(lambda: any(e["worker"] == "local" and e["to"] == "PAUSED" for e in worker_events(d.registry)),
                   120, what="the worker paused inside v1's update")  # fmt: skip
        d.kill()  # the daemon dies holding the worker PAUSED; the worker process lives on
        assert not serves(), "a paused worker answers nothing (the hold kept the daemon from resuming it)"

        d.env = {}  # the next daemon: no hold
        d.start(timeout=90)
        # well inside the supervisor's restart_timeout_s (180 s), which it used to wait out
        wait_until(serves, 60, what="the adopted worker back in rotation")
        assert json.loads(runtime_file.read_text())["pid"] == runtime["pid"]  # resumed, not relaunched
        d.wait_status("v1", "deployed", timeout=120)  # and the interrupted rollout is finished
        wait_until(serves, 60, what="the worker serving v1")
    finally:
        d.close()
        with contextlib.suppress(OSError, ValueError, TypeError):
            os.kill(json.loads(runtime_file.read_text())["pid"], signal.SIGKILL)
