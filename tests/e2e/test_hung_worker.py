"""A hung managed worker is replaced (issue 37, item 5), with real processes: a real daemon, its
managed reference worker SIGSTOPped.

The poll used to wait on the stopped worker (APScheduler skipped the next passes), `/health`
said ok for ~30 s and nothing relaunched it. Now the daemon's `/health` is red within one poll,
the worker is killed after HUNG_POLLS missed polls and relaunched on the port the daemon holds,
and a request sent to the serving port while it hung is answered by the relaunched worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, wait_until
from support_managed import close_managed, managed_daemon
from support_rollout import wait_passes, worker_events, worker_row

pytestmark = pytest.mark.timeout(600)


def _runtime(d: DaemonProcess) -> dict[str, Any]:
    return json.loads((d.state_dir / "worker-local.json").read_text())


def _polls(d: DaemonProcess) -> int:
    return int(d.get("/v1/rollout").json()["passes"]["health_poll"])


def _state(pid: int) -> str:
    """The process state letter in /proc (T: stopped), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_sigstopped_managed_worker_is_red_at_once_then_killed_and_relaunched(tmp_path: Path) -> None:
    started: list[DaemonProcess] = []
    stopped_pid = None
    try:
        d = managed_daemon(tmp_path, started, rollout={"request_timeout_s": 2.0})
        wait_until(lambda: worker_row(d.registry, "local")["state"] == "RUNNING", 240, what="the worker RUNNING")
        d.wait_status("tiny-seed", "deployed", timeout=120)
        wait_until(lambda: d.get("/health").status_code == 200, 60, what="/health green")
        wait_until(lambda: d.get("/v1/rollout").json()["current"] is None, 60, what="no rollout job running")
        wait_passes(d, "health_poll", 2)  # idle: the passes look at the worker
        rt = _runtime(d)
        port, stopped_pid = rt["port"], int(rt["pid"])
        before = _polls(d)
        os.kill(stopped_pid, signal.SIGSTOP)

        # a client that connects while the worker hangs: queued on the held port, answered after the relaunch
        answer: list[Any] = []

        def client() -> None:
            try:
                answer.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=180,
                                         json={"prompt": "hello", "max_tokens": 2}))  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - re-raised in the test thread below
                answer.append(exc)

        t = threading.Thread(target=client, daemon=True)
        t.start()

        wait_until(lambda: d.get("/health").status_code == 503, 60, what="/health red", interval=0.05)
        red_at = _polls(d)
        assert red_at <= before + 2, f"/health went red only after {red_at - before} polls: {d.get('/v1/rollout').text}"
        doc = d.get("/health").json()
        assert "no_worker_serving" in json.dumps(doc), doc
        row = worker_row(d.registry, "local")
        assert row["state"] in ("UNREACHABLE", "UNHEALTHY"), row

        wait_until(lambda: _state(stopped_pid) in ("gone", "Z"), 120, what="the hung worker killed")
        wait_until(lambda: _runtime(d)["pid"] != stopped_pid and worker_row(d.registry, "local")["state"] == "RUNNING",
                   240, what="the worker relaunched and RUNNING")  # fmt: skip
        wait_until(lambda: d.get("/health").status_code == 200, 60, what="/health green again")
        # it was serving when it hung: its kill is a crash of a healthy worker (worker_crashed), not a failed launch
        failed = [e for e in worker_events(d.registry)
                  if e["worker"] == "local" and e["detail"].get("action") == "crashed"]  # fmt: skip
        assert failed and "missed" in failed[-1]["detail"]["cause"], failed
        t.join(180)
        assert answer, "the client waiting on the hung worker got nothing"
        if isinstance(answer[0], Exception):
            raise answer[0]
        assert answer[0].status_code == 200, answer[0].text
        assert "hotswap_hung_workers_killed_total 1.0" in d.get("/metrics").text
    finally:
        if stopped_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped_pid, signal.SIGCONT)
        for d in started:
            close_managed(d)
