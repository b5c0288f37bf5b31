"""The model of health in-process: the problem book's since-times and changes, the worker probe's
reading of a host's workers, and what /health answers. The daemon-level tests (real processes:
tests/e2e/test_health_daemon.py) show each problem reaching /health, `hotswap status` and /metrics."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fake_worker import FakeWorkerClient

from daemon.common.problems import WARNING, Problem, ProblemBook
from daemon.config import RolloutSettings, WorkerSpec
from daemon.controller.problems import PAUSE_SERVES_S, WorkerProbe, last_rollout_problem, step_bound
from daemon.process.health import HealthMonitor, health_document
from daemon.registry import Registry, status
from daemon.registry.journal import Journal
from daemon.registry.status import CheckpointStatus as C
from daemon.registry.status import RolloutOutcome, RolloutTrigger
from daemon.rollout.managed import ManagedWorker
from daemon.rollout.states import WorkerHandle, WorkerSet, WorkerState

pytestmark = pytest.mark.quick


def test_a_problem_keeps_its_since_while_it_holds_and_each_start_and_end_is_said_once() -> None:
    book = ProblemBook()
    a, b = Problem("source_failing", "s3:x", "denied"), Problem("worker_stuck", "w0", "held", WARNING)
    current, ch = book.observe([a, b], now=100.0)
    assert [p.since for p in current] == [100.0, 100.0] and [p.key for p in ch.started] == [a.key, b.key]
    # a new reason for the same kind and subject is the same problem: the clock does not restart
    current, ch = book.observe([Problem("source_failing", "s3:x", "timed out")], now=105.0)
    assert [(p.reason, p.since) for p in current] == [("timed out", 100.0)]
    assert ch.started == [] and [p.key for p in ch.ended] == [b.key]
    current, ch = book.observe([], now=110.0)
    assert current == [] and [p.key for p in ch.ended] == [a.key]
    assert book.observe([a], now=120.0)[0][0].since == 120.0  # back again: a new since


def test_health_is_503_only_while_a_critical_problem_holds_and_lists_warnings_either_way() -> None:
    assert health_document([]) == ({"ok": True}, 200)
    warn = Problem("rollout_failed", "h", "rolled back", WARNING)
    doc, code = health_document([warn])
    assert code == 200 and doc["ok"] and doc["problems"][0]["kind"] == "rollout_failed"
    doc, code = health_document([Problem("no_worker_serving", "default", "w0 DRAINING"), warn])
    assert code == 503 and doc["error"] == "group default: w0 DRAINING" and len(doc["problems"]) == 2


@dataclass
class Service:
    """What the probe reads of a RolloutService."""

    fleet: WorkerSet
    journal: Journal
    settings: RolloutSettings = field(default_factory=RolloutSettings)
    ready: bool = True
    launches: list[tuple[str, str]] = field(default_factory=list)
    gates: list[tuple[str, str]] = field(default_factory=list)

    @property
    def supervisor(self) -> Service:
        return self

    def launch_problems(self) -> list[tuple[str, str]]:
        return self.launches

    def crash_problems(self) -> list[tuple[str, str]]:
        return []

    def adapter_problems(self) -> list[tuple[str, str]]:
        return []

    def gate_problems(self) -> list[tuple[str, str]]:
        return self.gates

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.ready


def _fleet(*workers: tuple[str, str, WorkerState | None]) -> WorkerSet:
    handles = []
    for name, group, state in workers:
        h = WorkerHandle(WorkerSpec(name=name, url=f"http://fake/{name}", group=group), FakeWorkerClient(name), "")
        h.observed(state)
        handles.append(h)
    return WorkerSet(handles)


def _kinds(problems: list[Problem]) -> set[tuple[str, str]]:
    return {p.key for p in problems}


def test_a_group_whose_only_worker_is_left_draining_is_not_serving(tmp_path: Path) -> None:
    # the reported outage: a failed rollback left the one worker DRAINING, answering 503
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    fleet = _fleet(("w0", "default", WorkerState.DRAINING))
    probe = WorkerProbe(Service(fleet, Journal(reg)))
    assert _kinds(probe.problems()) == {("no_worker_serving", "default"), ("worker_out_of_rotation", "w0")}
    fleet["w0"].observed(WorkerState.RUNNING)
    assert probe.problems() == []


def test_a_gate_that_cannot_run_is_a_warning_naming_the_gate_and_why(tmp_path: Path) -> None:
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    why = "gate p99 could not run: Prometheus at http://127.0.0.1:9 did not answer (on_error = wait: v2 held on trial)"
    found = WorkerProbe(Service(_fleet(("w0", "default", WorkerState.RUNNING)), Journal(reg), gates=[("p99", why)])).problems()
    assert [(p.kind, p.subject, p.reason, p.severity) for p in found] == [("gate_cannot_run", "p99", why, WARNING)]
    doc, code = health_document(found)
    assert code == 200 and doc["problems"][0]["kind"] == "gate_cannot_run"  # serving goes on: a warning


def test_a_worker_paused_by_an_update_still_serves_and_one_group_serving_is_enough(tmp_path: Path) -> None:
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    fleet = _fleet(("a0", "a", WorkerState.PAUSED), ("b0", "b", WorkerState.UNHEALTHY), ("b1", "b", WorkerState.RUNNING))
    probe = WorkerProbe(Service(fleet, Journal(reg)))
    with fleet["a0"].drive():  # an update holds it: its requests wait, none is refused
        fleet["a0"].left_running_at = time.monotonic()  # the pause began just now
        found = probe.problems()
    assert _kinds(found) == {("worker_out_of_rotation", "b0")}
    # the health poll takes the same lock only to look: a paused worker it reads is not serving
    with fleet["a0"].busy, fleet["b0"].busy:
        looked = probe.problems()
    assert _kinds(looked) == {("no_worker_serving", "a"), ("worker_out_of_rotation", "a0"),
                              ("worker_out_of_rotation", "b0")}  # fmt: skip
    # paused with nothing driving it: out of rotation, and its group does not serve
    assert _kinds(probe.problems()) == {("no_worker_serving", "a"), ("worker_out_of_rotation", "a0"),
                                        ("worker_out_of_rotation", "b0")}  # fmt: skip


def test_a_worker_held_by_a_rollout_past_its_step_timeouts_is_stuck(tmp_path: Path) -> None:
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    fleet = _fleet(("w0", "default", WorkerState.DRAINING), ("w1", "default", WorkerState.RUNNING))
    tiny = RolloutSettings(drain_timeout_s=0.01, update_timeout_s=0.01, restart_timeout_s=0.01, stage_timeout_s=0.01,
                           request_timeout_s=0.01)  # fmt: skip
    probe = WorkerProbe(Service(fleet, Journal(reg), tiny))
    release = threading.Event()
    with fleet["w0"].drive():
        assert WorkerProbe(Service(fleet, Journal(reg))).problems() == []  # the default steps allow minutes
        release.wait(0.2)
        stuck = probe.problems()
    assert [(p.kind, p.subject) for p in stuck] == [("worker_stuck", "w0")] and "held DRAINING" in stuck[0].reason


def test_the_stuck_bound_is_the_steps_of_the_state_not_the_sum_of_every_timeout() -> None:
    st = RolloutSettings()  # defaults: drain 30, update 300, restart 180, stage 600, each call 10
    assert step_bound(st, WorkerState.UPDATED) == 30.0  # a post-check is three calls
    assert step_bound(st, WorkerState.PAUSED) == 320.0  # the transfer
    assert step_bound(st, WorkerState.DRAINING) == 350.0  # the drain, then the transfer (drain mode)
    assert max(step_bound(st, s) for s in WorkerState) < 400.0  # was 1,110 s for every state


def test_a_pause_that_holds_requests_past_its_bound_is_no_worker_serving(tmp_path: Path) -> None:
    # a worker SIGSTOPped inside its update: PAUSED, driven by the rollout, and answering nobody
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    fleet = _fleet(("local", "default", WorkerState.PAUSED))
    probe = WorkerProbe(Service(fleet, Journal(reg)))
    with fleet["local"].drive():
        fleet["local"].left_running_at = time.monotonic() - PAUSE_SERVES_S - 5.0
        assert _kinds(probe.problems()) == {("no_worker_serving", "default")}


def test_a_managed_worker_whose_process_is_gone_serves_nobody_whatever_it_last_reported(tmp_path: Path) -> None:
    # the lone worker SIGKILLed inside its update: PAUSED a moment ago (within PAUSE_SERVES_S) and
    # driven, so it counted as serving until the engine's next call to it failed
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    fleet = _fleet(("local", "default", WorkerState.PAUSED))
    h = fleet["local"]
    h.managed = ManagedWorker(WorkerSpec(name="local", launch="managed", port=1), tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # stands in for the worker
    h.managed._proc, h.managed.pid = child, child.pid
    probe = WorkerProbe(Service(fleet, Journal(reg)))
    try:
        with h.drive():
            h.left_running_at = time.monotonic()
            assert probe.problems() == []  # alive, paused just now: its requests wait, none is refused
            child.kill()
            child.wait(30)
            found = [p for p in probe.problems() if p.kind == "no_worker_serving"]
            assert len(found) == 1 and "local PAUSED, its process gone" in found[0].reason, found
        h.observed(WorkerState.RUNNING)  # what it last reported does not matter either
        assert _kinds(probe.problems()) == {("no_worker_serving", "default")}
    finally:
        child.kill()
        child.wait(30)


def test_a_managed_worker_that_cannot_launch_is_critical_with_its_cause(tmp_path: Path) -> None:
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    fleet = _fleet(("local", "default", None))
    svc = Service(fleet, Journal(reg), launches=[("local", "exited with 1: no such file")])
    found = WorkerProbe(svc).problems()
    assert {(p.kind, p.severity) for p in found} == {("worker_launch_failed", "critical"), ("no_worker_serving", "critical")}
    svc.ready = False  # starting: nothing is said of launches yet, but a host that does not serve is not green
    assert [p.kind for p in WorkerProbe(svc).problems()] == ["no_worker_serving"]


def test_the_last_rollout_failing_is_a_warning_until_a_later_one_succeeds(tmp_path: Path) -> None:
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    reg.upgrade()
    journal = Journal(reg)
    with reg.session() as s:
        c = status.create(s, version="v1", source="t", uri="file:///v1", local_path=None, commit_signal="manifest")
        assert c is not None
        status.move(s, c, C.VERIFYING)
        status.move(s, c, C.VERIFIED)
        cid = c.id
    assert last_rollout_problem(journal) is None
    rid = journal.start_rollout(cid, trigger=RolloutTrigger.NEW, transport="disk", mode="drain", detail={})
    journal.finish_rollout(rid, RolloutOutcome.ROLLED_BACK, {"reason": "health window: 3 of 10 requests failed"})
    p = last_rollout_problem(journal)
    assert p is not None and p.severity == WARNING and "health window: 3 of 10" in p.reason and "v1" in p.reason
    rid = journal.start_rollout(cid, trigger=RolloutTrigger.MANUAL, transport="disk", mode="drain", detail={})
    journal.finish_rollout(rid, RolloutOutcome.SUCCEEDED)
    assert last_rollout_problem(journal) is None


class _Source:
    label = "s3:bucket/p/"

    def __init__(self) -> None:
        self.why: str | None = None

    def health_problem(self) -> str | None:
        return self.why


def test_the_monitor_records_each_start_and_end_as_an_event(tmp_path: Path) -> None:
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    reg.upgrade()
    src = _Source()
    mon = HealthMonitor(reg, lambda: [src])  # type: ignore[list-item]
    assert mon.check() == []
    src.why = "listing failed 1 time in a row: Unable to locate credentials"
    assert [p.kind for p in mon.check()] == ["source_failing"]
    mon.check()  # still holds: no second start
    src.why = None
    assert mon.check() == []
    from sqlalchemy import text

    with reg.engine.connect() as c:
        rows = c.execute(text("SELECT to_state, detail FROM events ORDER BY id")).all()
    assert [r[0] for r in rows] == ["problem_started", "problem_ended"]
