"""The supervisor on its own (daemon/controller/supervise.py), with a real child process and a real registry
but a worker that never answers: it is killed after `restart_timeout_s`, reported UNHEALTHY with
its log's last lines, and not relaunched before its backoff delay."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support_rollout import worker_events, worker_row

from daemon.config import RolloutSettings, WorkerSpec
from daemon.controller.supervise import Phase, Supervisor
from daemon.engines.base import WorkerError
from daemon.registry.journal import Journal
from daemon.rollout.driver import WorkerDriver
from daemon.rollout.managed import ManagedWorker, Restarter
from daemon.rollout.states import WorkerHandle, WorkerSet, WorkerState

pytestmark = pytest.mark.quick


class Silent:
    """A worker client whose worker never answers."""

    def weight_info(self) -> Any:
        raise WorkerError("connection refused")

    def close(self) -> None:
        pass


def test_a_worker_never_healthy_is_killed_reported_and_backed_off(registry: Any, tmp_path: Path) -> None:
    spec = WorkerSpec(name="m0", launch="managed", port=1, model=str(tmp_path))
    m = ManagedWorker(spec, tmp_path / "state")
    m.log_file.parent.mkdir(parents=True)
    m.log_file.write_text("an earlier launch\n")
    m.log_offset = m.log_file.stat().st_size
    with open(m.log_file, "a") as log:  # stands in for a worker stuck loading: alive, never healthy
        proc = subprocess.Popen([sys.executable, "-c", "print('loading...', flush=True); import time; time.sleep(60)"],
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    m._proc, m.pid, m.should_run, m.launches = proc, proc.pid, True, 1
    journal = Journal(registry)
    journal.register_workers([("m0", "builtin", m.url, "cpu")])
    settings = RolloutSettings(restart_timeout_s=0.5, relaunch_backoff_s=30.0, relaunch_backoff_max_s=60.0)
    h = WorkerHandle(spec=spec, client=Silent(), url=m.url, managed=m)  # type: ignore[arg-type]
    sup = Supervisor(journal, WorkerSet([h]), WorkerDriver(journal, settings, Restarter()), settings)
    try:
        sup.tick()
        assert sup.watches["m0"].phase == Phase.LAUNCHING
        time.sleep(0.3)  # the child prints its line
        sup.tick()
        assert proc.poll() is None, "killed before restart_timeout_s"
        deadline = time.monotonic() + 30
        while sup.watches["m0"].phase == Phase.LAUNCHING and time.monotonic() < deadline:
            time.sleep(0.1)
            sup.tick()
        assert proc.poll() is not None, "a worker never healthy was left running"
        row = worker_row(registry, "m0")
        assert row["state"] == WorkerState.UNHEALTHY.value
        first, *tail = row["last_error"].splitlines()
        assert first == "the worker was not healthy 0.5 s after launch; relaunch in 30 s (failure 1)", first
        assert tail == [f"--- last lines of {m.log_file} ---", "loading..."], tail  # this launch's lines only
        (event,) = [e for e in worker_events(registry) if e["detail"].get("action") == "launch_failed"]
        assert event["to"] == "UNHEALTHY" and event["detail"]["retry_in_s"] == 30.0
        assert sup.launch_problems() == [("m0", first)]
        sup.tick()  # the delay has not passed: not relaunched
        assert m.launches == 1 and sup.watches["m0"].phase == Phase.WAITING
    finally:
        proc.kill()
        proc.wait(10)
