"""The rollout engine, driver, recovery and health window in-process, against `FakeWorkerClient`s
and a real SQLite registry: every failure branch in milliseconds. The multi-process tests
(test_rollout_faults.py, test_rollout_e2e.py) stay the end-to-end proof with real workers.

The promise checked throughout: after any failure every worker is RUNNING on one whole version
(the fallback), or is named as unrecovered; never a mix.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until
from fake_worker import FAKES, MIXED, FakeWorkerClient, Restarts
from sqlalchemy import select
from support_rollout import rollouts, worker_events, worker_row

from daemon import engines
from daemon.config import RolloutSettings, WorkerSpec
from daemon.controller.service import RolloutService
from daemon.controller.startup import NEVER_MOVED
from daemon.engines.base import NonFiniteOutput, UpdateRefused, WorkerError
from daemon.registry import Registry, status
from daemon.registry.journal import CheckpointRef, Journal
from daemon.registry.models import Checkpoint, Event
from daemon.registry.status import CheckpointStatus as C
from daemon.registry.status import FailureKind, RolloutOutcome, RolloutTrigger
from daemon.rollout import health
from daemon.rollout.driver import WorkerDriver
from daemon.rollout.engine import RolloutEngine
from daemon.rollout.recovery import Recovery
from daemon.rollout.stage import Stager
from daemon.rollout.states import Transition, WorkerHandle, WorkerSet, WorkerState
from daemon.transport.base import SenderOptions

pytestmark = pytest.mark.quick

S = WorkerState
FAST = {"health_window_s": 0.0, "restart_timeout_s": 2.0, "drain_timeout_s": 1.0, "rejoin_s": 0.0}


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Registry]:
    r = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    r.upgrade()
    yield r
    r.close()


# the checkpoints' directories exist (the disk sender refuses a version whose directory is gone)
CKPT_ROOT = Path(tempfile.mkdtemp(prefix="hotswap-fake-ckpt-"))
atexit.register(shutil.rmtree, CKPT_ROOT, True)


def verified(reg: Registry, version: str, digest: str | None = None, step: int | None = None) -> CheckpointRef:
    local = CKPT_ROOT / version
    local.mkdir(exist_ok=True)
    with reg.session() as s:
        c = status.create(s, version=version, source="t", uri=f"file://{local}", local_path=str(local),
                          commit_signal="manifest")  # fmt: skip
        assert c is not None
        c.digest, c.tensor_count, c.step = digest, 21, step
        status.move(s, c, C.VERIFYING)
        status.move(s, c, C.VERIFIED)
        cid = c.id
    ref = Journal(reg).checkpoint(cid)
    assert ref is not None
    return ref


@dataclass
class Rig:
    reg: Registry
    journal: Journal
    fleet: WorkerSet
    fakes: dict[str, FakeWorkerClient]
    driver: WorkerDriver
    engine: RolloutEngine
    restarts: Restarts
    seen: list[Transition]

    def deploy(self, ckpt: CheckpointRef, fallback: CheckpointRef | None, **kw: Any) -> Any:
        return self.engine.deploy(ckpt, trigger=RolloutTrigger.NEW, fallback=fallback, **kw)

    def path(self, rollout_id: int, worker: str) -> list[tuple[str, str, str]]:
        return [(e["from"], e["to"], e["detail"].get("action") or e["detail"].get("step") or "")
                for e in worker_events(self.reg, rollout_id) if e["worker"] == worker]  # fmt: skip

    def on(self) -> set[tuple[str, str | None]]:
        return {(f.state, f.version) for f in self.fakes.values()}


def rig(reg: Registry, tmp_path: Path, *fakes: FakeWorkerClient, mode: str = "drain",
        groups: dict[str, str] | None = None, **settings: Any) -> Rig:  # fmt: skip
    """`groups`: worker name -> group (default: every worker in the one "default" group)."""
    cfg = RolloutSettings(mode=mode, **{**FAST, **settings})  # type: ignore[arg-type]
    journal = Journal(reg)
    handles = [WorkerHandle(WorkerSpec(name=f.name, url=f"http://fake/{f.name}",
                                       group=(groups or {}).get(f.name, "default")), f, f"http://fake/{f.name}")
               for f in fakes]  # fmt: skip
    fleet = WorkerSet(handles)
    journal.register_workers((h.name, "builtin", h.url, "cpu") for h in fleet)
    restarts = Restarts({f.name: f for f in fakes})
    seen: list[Transition] = []
    driver = WorkerDriver(journal, cfg, restarts, observers=[seen.append])  # type: ignore[arg-type]
    stager = Stager("disk", SenderOptions(tmp_path))
    engine = RolloutEngine(journal, fleet, cfg, driver, stager)
    return Rig(reg, journal, fleet, {f.name: f for f in fakes}, driver, engine, restarts, seen)


FORWARD = [("RUNNING", "DRAINING", ""), ("DRAINING", "UPDATED", ""), ("UPDATED", "RUNNING", "")]
PAUSED_FORWARD = [("RUNNING", "PAUSED", ""), ("PAUSED", "UPDATED", ""), ("UPDATED", "RUNNING", "")]


def test_a_rollout_moves_every_worker_through_the_state_machine_in_order(reg: Registry, tmp_path: Path) -> None:
    r = rig(reg, tmp_path, FakeWorkerClient("w0"), FakeWorkerClient("w1"))
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.SUCCEEDED and res.moved == ["w0", "w1"]
    assert r.on() == {("RUNNING", "v1")}
    for w in ("w0", "w1"):
        assert r.path(res.rollout_id, w) == FORWARD
    # observers hear every transition after it was recorded, with the version it moves to
    assert [(t.worker, t.to_state, t.version) for t in r.seen][:3] == [
        ("w0", S.DRAINING, "v1"), ("w0", S.UPDATED, "v1"), ("w0", S.RUNNING, "v1")]  # fmt: skip
    # already there: nothing moves
    again = r.deploy(v1, v0)
    assert again.outcome == RolloutOutcome.SUCCEEDED and again.moved == []


@pytest.mark.parametrize(("mode", "rejoin_s"), [("drain", 0.3), ("pause", 5.0)])
def test_in_drain_mode_the_next_batch_drains_only_after_the_last_one_had_time_to_rejoin(
    reg: Registry, tmp_path: Path, mode: str, rejoin_s: float
) -> None:
    """A load balancer sees a resumed worker at its next health check; draining the next worker
    at once could leave it nothing in rotation (seen: one request refused by both workers)."""
    r = rig(reg, tmp_path, FakeWorkerClient("w0"), FakeWorkerClient("w1"), mode=mode, rejoin_s=rejoin_s)
    at: dict[tuple[str, WorkerState], float] = {}
    r.driver.observers.append(lambda t: at.setdefault((t.worker, t.to_state), time.monotonic()))
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    assert r.deploy(v1, v0).outcome == RolloutOutcome.SUCCEEDED and r.on() == {("RUNNING", "v1")}
    begin = S.DRAINING if mode == "drain" else S.PAUSED
    gap = at[("w1", begin)] - at[("w0", S.RUNNING)]
    if mode == "drain":
        assert gap >= rejoin_s, gap
    else:  # paused requests wait in the worker instead of being refused: no wait
        assert gap < rejoin_s, gap


def test_a_lone_worker_in_drain_mode_is_paused_and_the_rollout_says_why(reg: Registry, tmp_path: Path) -> None:
    """Draining the only worker of a group turns every request away until it is back (seen: 99 of
    1,462 requests got 503 in three rollouts of the embedded default); pausing it holds them."""
    w0 = FakeWorkerClient("w0")
    r = rig(reg, tmp_path, w0, mode="drain")
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.SUCCEEDED and r.on() == {("RUNNING", "v1")}
    assert r.path(res.rollout_id, "w0") == [("RUNNING", "PAUSED", ""), ("PAUSED", "UPDATED", ""), ("UPDATED", "RUNNING", "")]
    assert "pause" in w0.calls and "drain" not in w0.calls
    why = "only worker of group default: paused instead of drained"
    row = rollouts(reg)[-1]
    assert row["mode"] == "pause", row
    assert row["detail"]["batch_modes"] == [{"group": "default", "workers": ["w0"], "mode": "pause", "reason": why}]
    begin = [e for e in worker_events(reg, res.rollout_id) if e["to"] == "PAUSED"]
    assert [e["detail"] for e in begin] == [{"mode": "pause", "reason": why}]


def test_a_group_of_two_still_drains_one_at_a_time_beside_a_lone_worker_that_is_paused(
    reg: Registry, tmp_path: Path
) -> None:
    w0, w1, w2 = FakeWorkerClient("w0"), FakeWorkerClient("w1"), FakeWorkerClient("w2")
    r = rig(reg, tmp_path, w0, w1, w2, mode="drain", groups={"w0": "pair", "w1": "pair", "w2": "solo"})
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.SUCCEEDED and r.on() == {("RUNNING", "v1")}
    # one of the pair out of rotation at a time: w1 drains only once w0 is back RUNNING
    order = [(t.worker, t.to_state) for t in r.seen]
    assert order == [("w0", S.DRAINING), ("w0", S.UPDATED), ("w0", S.RUNNING),
                     ("w1", S.DRAINING), ("w1", S.UPDATED), ("w1", S.RUNNING),
                     ("w2", S.PAUSED), ("w2", S.UPDATED), ("w2", S.RUNNING)], order  # fmt: skip
    assert "drain" in w0.calls and "drain" in w1.calls and "pause" not in w0.calls + w1.calls
    row = rollouts(reg)[-1]
    assert row["mode"] == "mixed"
    assert [(b["group"], b["mode"]) for b in row["detail"]["batch_modes"]] == [("solo", "pause")]
    assert all("reason" not in e["detail"] for e in worker_events(reg, res.rollout_id) if e["to"] == "DRAINING")


def test_a_lone_worker_that_cannot_pause_is_drained_with_a_warning_once(reg: Registry, tmp_path: Path) -> None:
    import structlog

    w0 = FakeWorkerClient("w0", pause_modes=())
    r = rig(reg, tmp_path, w0, mode="drain")
    v0, v1, v2 = verified(reg, "v0"), verified(reg, "v1"), verified(reg, "v2")
    with structlog.testing.capture_logs() as logs:
        assert r.deploy(v1, v0).outcome == RolloutOutcome.SUCCEEDED
        res = r.deploy(v2, v1)
    assert res.outcome == RolloutOutcome.SUCCEEDED and r.on() == {("RUNNING", "v2")}
    assert r.path(res.rollout_id, "w0")[0] == ("RUNNING", "DRAINING", "")
    warned = [e for e in logs if e["event"] == "group_out_of_rotation_during_updates"]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning" and warned[0]["group"] == "default", logs
    assert "w0 cannot pause without losing requests" in warned[0]["reason"]
    assert rollouts(reg)[-1]["mode"] == "drain"
    assert "out of rotation" in rollouts(reg)[-1]["detail"]["batch_modes"][0]["reason"]


def test_no_rejoin_wait_after_a_batch_that_drained_nobody(reg: Registry, tmp_path: Path) -> None:
    """w0 is already on the target (nothing left rotation): w1 is drained without the wait."""
    r = rig(reg, tmp_path, FakeWorkerClient("w0", version="v1"), FakeWorkerClient("w1"), rejoin_s=30.0)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    t0 = time.monotonic()
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.SUCCEEDED and res.moved == ["w1"] and r.on() == {("RUNNING", "v1")}
    assert time.monotonic() - t0 < 30.0  # a rejoin wait would have taken 30 s


def test_a_refused_update_rolls_back_the_workers_already_moved(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeWorkerClient("w0"), FakeWorkerClient("w1")
    r = rig(reg, tmp_path, w0, w1)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    w1.fail("update", UpdateRefused("worker w1: update: HTTP 409: tensor table does not match"))
    res = r.deploy(v1, v0)
    assert (res.outcome, res.kind, res.unrecovered) == (RolloutOutcome.FAILED, FailureKind.REFUSED, [])
    assert r.on() == {("RUNNING", "v0")}  # no mixed versions
    # a refusal is not a failure of the worker: it kept serving v0, never UNHEALTHY (issue 21)
    assert r.path(res.rollout_id, "w1") == [("RUNNING", "DRAINING", ""), ("DRAINING", "RUNNING", "refused")]
    assert r.path(res.rollout_id, "w0") == FORWARD + FORWARD  # to v1, then back to v0
    assert "rollback" in w0.calls  # going back installs the fallback's request
    (row,) = [x for x in rollouts(reg) if x["id"] == res.rollout_id]
    assert row["detail"]["rolled_back"] == ["w0"] and row["detail"]["kind"] == "refused"


def test_a_lone_worker_that_refused_goes_to_the_fallback_paused_not_drained(reg: Registry, tmp_path: Path) -> None:
    """It kept serving a version other than the fallback; moving it there must not drain the
    group's only worker either."""
    w0 = FakeWorkerClient("w0", version="vx")
    r = rig(reg, tmp_path, w0, mode="drain")
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    w0.fail("update", UpdateRefused("worker w0: update: HTTP 409: tensor table does not match"))
    res = r.deploy(v1, v0)
    assert (res.outcome, res.kind, res.unrecovered) == (RolloutOutcome.FAILED, FailureKind.REFUSED, [])
    assert r.on() == {("RUNNING", "v0")}
    assert r.path(res.rollout_id, "w0") == [("RUNNING", "PAUSED", ""), ("PAUSED", "RUNNING", "refused"), *PAUSED_FORWARD]
    assert "drain" not in w0.calls


def test_a_worker_that_dies_mid_update_is_restarted_on_the_fallback(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeWorkerClient("w0"), FakeWorkerClient("w1")
    r = rig(reg, tmp_path, w0, w1)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    w1.fail("update", crash=True)
    res = r.deploy(v1, v0)
    assert (res.outcome, res.kind, res.unrecovered) == (RolloutOutcome.FAILED, FailureKind.UNREACHABLE, [])
    assert r.restarts.done == ["w1"] and r.on() == {("RUNNING", "v0")}
    assert r.path(res.rollout_id, "w1") == [
        ("RUNNING", "DRAINING", ""), ("DRAINING", "UNHEALTHY", "update"), ("UNHEALTHY", "UNHEALTHY", "restore_failed"),
        ("UNHEALTHY", "UNHEALTHY", "restart"), ("UNHEALTHY", "RUNNING", "restored"),
    ]  # fmt: skip


def test_a_failed_post_check_restores_the_last_good_version(reg: Registry, tmp_path: Path) -> None:
    w0 = FakeWorkerClient("w0")
    r = rig(reg, tmp_path, w0, mode="pause")
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    w0.fail("probe", served="something-else")
    res = r.deploy(v1, v0)
    assert (res.outcome, res.kind) == (RolloutOutcome.FAILED, FailureKind.MISMATCH)
    assert r.on() == {("RUNNING", "v0")}
    assert [(a, b) for a, b, _ in r.path(res.rollout_id, "w0")] == [
        ("RUNNING", "PAUSED"), ("PAUSED", "UPDATED"), ("UPDATED", "UNHEALTHY"), ("UNHEALTHY", "RUNNING")]  # fmt: skip


def test_a_partial_write_on_an_engine_without_atomic_updates_is_uncertain_until_reinstalled(
    reg: Registry, tmp_path: Path
) -> None:
    w0 = FakeWorkerClient("w0", atomic=False, restores_itself=False)
    r = rig(reg, tmp_path, w0)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    w0.fail("update", partial=True)
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.FAILED and res.unrecovered == []
    # (a lone worker: paused rather than drained, see the planner)
    assert r.path(res.rollout_id, "w0") == [("RUNNING", "PAUSED", ""), ("PAUSED", "UNCERTAIN", "update"),
                                            ("UNCERTAIN", "RUNNING", "restored")]  # fmt: skip
    assert (w0.state, w0.version) == ("RUNNING", "v0") and w0.calls.count("rollback") == 1  # v0 re-installed


def test_a_worker_held_uncertain_is_reinstalled_even_when_it_answers_running_on_the_target(
    reg: Registry, tmp_path: Path
) -> None:
    # drift seen at start-up (the same label from another folder), then the rollout of that very
    # version: the worker's answer "RUNNING on v1" must not wave it through as already updated
    w0, w1 = FakeWorkerClient("w0"), FakeWorkerClient("w1")
    r = rig(reg, tmp_path, w0, w1)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    assert r.deploy(v1, v0).outcome == RolloutOutcome.SUCCEEDED
    h = r.fleet["w0"]
    r.driver.move(h, None, S.UNCERTAIN, duration_ms=None, error="drift: test")
    before = w0.calls.count("rollback") + w0.calls.count("update")
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.SUCCEEDED
    # back on the known-good fallback first (as any failed worker before a rollout), then its batch
    assert r.path(res.rollout_id, "w0") == [("UNCERTAIN", "RUNNING", "restored"), *FORWARD]
    assert w0.calls.count("rollback") + w0.calls.count("update") == before + 2
    assert (w0.state, w0.version) == ("RUNNING", "v1") and h.state == S.RUNNING
    assert worker_row(reg, "w0")["state"] == "RUNNING"
    assert r.path(res.rollout_id, "w1") == []  # the other was on the target: untouched


def test_an_uncertain_worker_whose_reinstall_fails_is_restarted(reg: Registry, tmp_path: Path) -> None:
    w0 = FakeWorkerClient("w0", atomic=False, restores_itself=False)
    r = rig(reg, tmp_path, w0)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    w0.fail("update", partial=True)
    w0.fail("rollback", partial=True)
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.FAILED and res.unrecovered == []
    assert [(a, b, s) for a, b, s in r.path(res.rollout_id, "w0")][1:] == [
        ("PAUSED", "UNCERTAIN", "update"), ("UNCERTAIN", "UNHEALTHY", "restore_failed"),
        ("UNHEALTHY", "UNHEALTHY", "restart"), ("UNHEALTHY", "RUNNING", "restored"),
    ]  # fmt: skip
    assert (w0.state, w0.version) == ("RUNNING", "v0") and w0.version != MIXED


def test_a_worker_that_cannot_be_brought_back_is_named_and_the_rest_serve_the_fallback(
    reg: Registry, tmp_path: Path
) -> None:
    w0, w1 = FakeWorkerClient("w0"), FakeWorkerClient("w1")
    r = rig(reg, tmp_path, w0, w1)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    w1.fail("update", crash=True)
    r.restarts.refuse.add("w1")
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.FAILED and res.unrecovered == ["w1"]
    assert (w0.state, w0.version) == ("RUNNING", "v0")  # the healthy one is back on the fallback
    assert r.fleet["w1"].state == S.UNHEALTHY
    assert r.journal.worker_state("w1")[0] == "UNHEALTHY"


def test_a_dead_worker_before_the_rollout_is_brought_back_first_or_the_rollout_does_not_start(
    reg: Registry, tmp_path: Path
) -> None:
    w0, w1 = FakeWorkerClient("w0"), FakeWorkerClient("w1")
    r = rig(reg, tmp_path, w0, w1)
    v0, v1, v2 = verified(reg, "v0"), verified(reg, "v1"), verified(reg, "v2")
    w1.alive = False
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.SUCCEEDED and r.on() == {("RUNNING", "v1")}
    assert r.path(res.rollout_id, "w1")[0] == ("RUNNING", "UNHEALTHY", "preflight")
    w1.alive = False
    r.restarts.refuse.add("w1")
    res = r.deploy(v2, v1)
    assert (res.outcome, res.kind, res.unrecovered) == (RolloutOutcome.FAILED, FailureKind.UNAVAILABLE, ["w1"])
    assert (w0.state, w0.version) == ("RUNNING", "v1") and r.path(res.rollout_id, "w0") == []  # nobody moved


def test_without_a_known_fallback_a_worker_that_cannot_restore_itself_is_restarted(
    reg: Registry, tmp_path: Path
) -> None:
    w0 = FakeWorkerClient("w0", version="boot", restores_itself=False)
    r = rig(reg, tmp_path, w0)
    v1 = verified(reg, "v1")
    w0.fail("probe", served="boot")
    res = r.deploy(v1, None)
    assert res.outcome == RolloutOutcome.FAILED and r.restarts.done == ["w0"]
    assert r.path(res.rollout_id, "w0")[-2:] == [("UNHEALTHY", "UNHEALTHY", "restart"), ("UNHEALTHY", "RUNNING", "restored")]


def test_a_batch_boundary_yields_to_newer_work(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeWorkerClient("w0"), FakeWorkerClient("w1")
    r = rig(reg, tmp_path, w0, w1)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    batches = iter([False, True])
    res = r.deploy(v1, v0, should_yield=lambda: next(batches))
    assert res.outcome == RolloutOutcome.SUPERSEDED and res.moved == ["w0"]
    assert (w0.version, w1.version) == ("v1", "v0")


# -- crash recovery ----------------------------------------------------------------------------


def _open_rollout(r: Rig, ckpt: CheckpointRef, fallback: CheckpointRef) -> int:
    return r.journal.start_rollout(ckpt.id, trigger=RolloutTrigger.NEW, transport="disk", mode="drain",
                                   detail={"version": ckpt.version, "fallback": fallback.version})  # fmt: skip


def test_recovery_finishes_a_rollout_a_killed_daemon_left_half_way(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeWorkerClient("w0"), FakeWorkerClient("w1")
    r = rig(reg, tmp_path, w0, w1)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    rid = _open_rollout(r, v1, v0)
    target = r.engine.fallback_target(v1)
    assert target is not None
    r.driver.update(r.fleet["w0"], rid, target, "drain")  # w0 done
    r.driver.begin(r.fleet["w1"], rid, "drain", "v1")  # w1 DRAINING when the daemon died
    fresh = rig(reg, tmp_path, w0, w1)  # a new daemon: nothing known in memory
    rollout = fresh.journal.unfinished_rollouts()[-1]
    rec = Recovery(fresh.journal, fresh.engine, fresh.driver).run(rollout, v0)
    assert (rec.finished, rec.version, rec.unrecovered) == (True, "v1", [])
    assert fresh.on() == {("RUNNING", "v1")}
    assert [(a, b) for a, b, _ in fresh.path(rid, "w1")] == [("RUNNING", "DRAINING"), ("DRAINING", "UPDATED"),
                                                               ("UPDATED", "RUNNING")]  # fmt: skip


def test_recovery_undoes_a_rollout_whose_failure_path_had_begun(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeWorkerClient("w0"), FakeWorkerClient("w1")
    r = rig(reg, tmp_path, w0, w1)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    rid = _open_rollout(r, v1, v0)
    target = r.engine.fallback_target(v1)
    assert target is not None
    r.driver.update(r.fleet["w0"], rid, target, "drain")
    r.driver.begin(r.fleet["w1"], rid, "drain", "v1")
    r.driver.transfer(r.fleet["w1"], rid, target)
    r.driver.move(r.fleet["w1"], rid, S.UNHEALTHY, duration_ms=None, detail={"step": "post_check"})  # then killed
    fresh = rig(reg, tmp_path, w0, w1)
    rec = Recovery(fresh.journal, fresh.engine, fresh.driver).run(fresh.journal.unfinished_rollouts()[-1], v0)
    assert (rec.finished, rec.version, rec.unrecovered) == (False, "v0", [])
    assert fresh.on() == {("RUNNING", "v0")}  # everyone back on the fallback: no mixed versions


def test_recovery_restarts_a_worker_that_does_not_answer(reg: Registry, tmp_path: Path) -> None:
    w0 = FakeWorkerClient("w0")
    r = rig(reg, tmp_path, w0)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    rid = _open_rollout(r, v1, v0)
    r.driver.begin(r.fleet["w0"], rid, "drain", "v1")
    w0.alive = False  # died with the daemon
    fresh = rig(reg, tmp_path, w0)
    rec = Recovery(fresh.journal, fresh.engine, fresh.driver).run(fresh.journal.unfinished_rollouts()[-1], v0)
    assert rec.unrecovered == [] and fresh.restarts.done == ["w0"] and w0.state == "RUNNING"


# -- the health window -------------------------------------------------------------------------


def _during(fn: Any) -> Any:
    """A should_abort that runs `fn` once, at the window's first sample (traffic inside the window)."""
    done: list[bool] = []

    def abort() -> bool:
        if not done:
            done.append(True)
            fn()
        return False

    return abort


def test_health_window_verdicts(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeWorkerClient("w0"), FakeWorkerClient("w1")
    r = rig(reg, tmp_path, w0, w1)
    settings = RolloutSettings(health_window_s=0.05, health_sample_s=0.01, max_error_rate=0.01, min_window_requests=5,
                               health_probe_s=0)  # fmt: skip
    w0.traffic(100, failed=50)  # before the window: not counted
    assert health.watch(r.fleet, settings, lambda: False).ok

    verdict = health.watch(r.fleet, settings, _during(lambda: (w0.traffic(10), w1.traffic(10, failed=3))))
    assert not verdict.ok
    assert verdict.reason is not None and "worker w1 error rate 30.0% (3 of 10 requests failed)" in verdict.reason
    assert verdict.workers["w0"] == {"requests": 10, "failed": 0, "probes": 0, "probes_failed": 0, "rate": 0.0}

    few = health.watch(r.fleet, settings, _during(lambda: w1.traffic(2, failed=2)))
    assert few.ok  # 2 requests < min_window_requests: no verdict on w1
    assert health.watch(r.fleet, settings, lambda: True).aborted
    w1.alive = False
    gone = health.watch(r.fleet, settings, lambda: False)
    assert not gone.ok and "worker w1 did not answer at the start of the health window" in (gone.reason or "")


def test_health_window_one_bad_request_cannot_trip_it_and_probes_count(reg: Registry, tmp_path: Path) -> None:
    """Finding 6: one failed request of one (100 %) is below the default minimum of 10 requests;
    the daemon's probes count as requests, a non-finite or wrong-version probe is decisive."""
    w0 = FakeWorkerClient("w0", version="v1")
    r = rig(reg, tmp_path, w0)
    settings = RolloutSettings(health_window_s=0.05, health_sample_s=0.01, health_probe_s=0.01)
    assert settings.min_window_requests == 10
    one = health.watch(r.fleet, settings, _during(lambda: w0.traffic(1, failed=1)), "v1")
    assert one.ok, one.reason
    assert one.workers["w0"]["failed"] == 1 and one.workers["w0"]["probes"] >= 1
    # enough server faults still trip it
    many = health.watch(r.fleet, settings, _during(lambda: w0.traffic(20, failed=5)), "v1")
    assert not many.ok and "worker w0 error rate" in (many.reason or "")
    # a probe with non-finite logits is a fault of the weights: decisive, whatever the counts
    w0.fail("probe", NonFiniteOutput("worker w0: probe: non-finite logits under version v1"))
    nan = health.watch(r.fleet, settings, lambda: False, "v1")
    assert not nan.ok and "non-finite logits" in (nan.reason or "") and "health window" in (nan.reason or "")
    w0.fail("probe", served="v0")
    other = health.watch(r.fleet, settings, lambda: False, "v1")
    assert not other.ok and "served version 'v0', expected 'v1'" in (other.reason or "")
    # a probe that errors otherwise (HTTP 500) is one failed request, not a verdict on its own
    w0.fail("probe", WorkerError("worker w0: probe: HTTP 500: boom"))
    err = health.watch(r.fleet, settings, lambda: False, "v1")
    assert err.ok and err.workers["w0"]["probes_failed"] == 1


def test_the_health_window_is_a_condition_stepped_to_its_verdict_without_sleeping(
    reg: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HealthWatch samples only when due and gives its verdict at the deadline; a step never waits
    (the runner steps it between its passes: daemon.controller.service)."""
    w0 = FakeWorkerClient("w0")
    r = rig(reg, tmp_path, w0)
    now = [100.0]
    monkeypatch.setattr(health.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(health.time, "sleep", lambda _s: pytest.fail("a step slept"))
    settings = RolloutSettings(health_window_s=1.0, health_sample_s=0.25, max_error_rate=0.01, min_window_requests=5,
                               health_probe_s=0)  # fmt: skip
    window = health.HealthWatch(r.fleet, settings, lambda: False, "v0")
    assert window.due == 100.25 and window.step() is None  # not due yet: nothing sampled
    w0.traffic(10, failed=3)
    now[0] = 100.25
    assert window.step() is None and window.tallies["w0"].failed == 3 and window.due == 100.5
    now[0] = 100.9
    assert window.step() is None and window.due == 101.0  # the last sample is at the deadline
    now[0] = 101.0
    verdict = window.step()
    assert verdict is not None and not verdict.ok and "worker w0 error rate 30.0%" in (verdict.reason or "")
    assert window.step() is verdict  # decided: asked again, the same verdict
    stopped = health.HealthWatch(r.fleet, settings, lambda: True)
    assert (v := stopped.step()) is not None and v.aborted


# -- the service over fakes: a whole new-checkpoint job, through the kind registry ---------------


@pytest.fixture
def fake_kind(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(engines.WORKER_KINDS, "fake", "fake_worker:connect")  # the one registry line
    yield
    FAKES.clear()


def _service(reg: Registry, tmp_path: Path, *fakes: FakeWorkerClient, **settings: Any) -> RolloutService:
    for f in fakes:
        FAKES[f.name] = f
    specs = [WorkerSpec(name=f.name, url=f"http://fake/{f.name}", kind="fake") for f in fakes]
    svc = RolloutService(reg, RolloutSettings(**{**FAST, **settings}), specs, tmp_path, restarter=Restarts(dict(FAKES)))  # type: ignore[arg-type]
    svc.start()
    assert svc.wait_ready(10)
    return svc


def test_workers_ahead_false_leaves_the_stager_without_asks_and_the_default_has_them(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    """`[rollout] workers_ahead = false`: no worker is asked to open or read a version while it is
    verified (the stager's asks are what sends those requests)."""
    from daemon.config import parse_config

    assert parse_config({"rollout": {"workers_ahead": False}}, "t.toml").rollout.workers_ahead is False
    for ahead in (True, False):
        svc = _service(reg, tmp_path / str(ahead), FakeWorkerClient(f"w-{ahead}"), workers_ahead=ahead)
        try:
            assert (svc.stager.asks is not None) is ahead
        finally:
            svc.stop()


def test_service_deploys_a_new_checkpoint_and_records_serving(reg: Registry, tmp_path: Path, fake_kind: None) -> None:
    svc = _service(reg, tmp_path, FakeWorkerClient("w0"), FakeWorkerClient("w1"))
    try:
        v0 = verified(reg, "v0")
        svc.journal.set_alias("serving", v0.id)
        svc.journal.set_alias("last_good", v0.id)
        v1 = verified(reg, "v1")
        out = svc.decisions.deploy_new(v1)
        assert out["outcome"] == "succeeded"
        assert svc.journal.alias("serving") == svc.journal.checkpoint(v1.id)
        assert svc.journal.checkpoint(v1.id).status == C.DEPLOYED  # type: ignore[union-attr]
        assert svc.state.serving == "v1" and {f.version for f in FAKES.values()} == {"v1"}
    finally:
        svc.stop()


def test_service_rejects_a_version_whose_rollout_failed_and_keeps_serving(reg: Registry, tmp_path: Path, fake_kind: None) -> None:
    w1 = FakeWorkerClient("w1")
    svc = _service(reg, tmp_path, FakeWorkerClient("w0"), w1)
    try:
        v0 = verified(reg, "v0")
        svc.journal.set_alias("serving", v0.id)
        svc.journal.set_alias("last_good", v0.id)
        v1 = verified(reg, "v1")
        w1.fail("update", UpdateRefused("worker w1: update: HTTP 409: shape"))
        out = svc.decisions.deploy_new(v1)
        row = svc.journal.checkpoint(v1.id)
        assert out["outcome"] == "failed" and row is not None and row.status == C.REJECTED
        assert svc.journal.alias("serving") == svc.journal.checkpoint(v0.id)
        assert {(f.state, f.version) for f in FAKES.values()} == {("RUNNING", "v0")}
    finally:
        svc.stop()


# A daemon that stopped while a rollout had not moved a worker yet (a fleet host waits for its
# lease slot there, its rollout row already written): at start a fleet rollout is closed and the
# fleet agent decides again, since its stage may have halted meanwhile; any other is finished as
# crash recovery always did.


def _left_open(reg: Registry, trigger: RolloutTrigger) -> int:
    """v0 serving, v1 verified, a rollout of v1 opened and never finished (no worker event)."""
    j = Journal(reg)
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    j.set_alias("serving", v0.id)
    j.set_alias("last_good", v0.id)
    return j.start_rollout(v1.id, trigger=trigger, transport="disk", mode="drain",
                           detail={"version": "v1", "fallback": "v0"})  # fmt: skip


def test_a_fleet_rollout_that_moved_no_worker_is_closed_at_start(reg: Registry, tmp_path: Path, fake_kind: None) -> None:
    """Closed, not finished: no worker moves under the old rollout row. This daemon has no fleet
    agent to hold v1 back, so v1, still verified, then deploys in a rollout of its own (CI: the
    test once read the workers while that new rollout moved them)."""
    rid = _left_open(reg, RolloutTrigger.FLEET)
    svc = _service(reg, tmp_path, FakeWorkerClient("w0"), FakeWorkerClient("w1"))
    try:
        row = next(r for r in rollouts(reg) if r["id"] == rid)
        assert row["outcome"] == "superseded" and row["detail"]["reason"] == NEVER_MOVED
        after = wait_until(lambda: [r for r in rollouts(reg) if r["id"] > rid and r["outcome"]], 30,
                           what="v1's own rollout")  # fmt: skip
        assert [(r["version"], r["trigger"], r["outcome"]) for r in after] == [("v1", "new", "succeeded")]
        assert worker_events(reg, rid) == []  # the closed row moved nobody
        assert {(f.state, f.version) for f in FAKES.values()} == {("RUNNING", "v1")}
    finally:
        svc.stop()



def test_a_rollout_finished_at_start_has_its_window_watched_as_the_first_job(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    """Crash recovery finishes v1's rollout at start. Its health window is then the first job, not
    a wait before the daemon is ready (the API answered 503 "still starting" for the whole window):
    ready at once, status names the window, and an operator's rollback, taken at once, ends it."""
    rid = _left_open(reg, RolloutTrigger.NEW)
    svc = _service(reg, tmp_path, FakeWorkerClient("w0"), FakeWorkerClient("w1"), health_window_s=60.0,
                   health_sample_s=0.05, health_probe_s=0.0)  # ready within 10 s, not after the window  # fmt: skip
    try:
        row = next(r for r in rollouts(reg) if r["id"] == rid)
        assert row["outcome"] == "succeeded" and row["detail"].get("recovered") is True
        wait_until(lambda: svc.status()["current"] == "health window v1", 20, what="v1's window held by the runner")
        window = svc.status()["window"]
        assert (window["version"], window["rollout_id"]) == ("v1", rid)
        assert svc.journal.alias("last_good") == svc.journal.checkpoint_by_version("v0")  # not trusted yet
        assert svc.rollback(to="v0").result(20)["outcome"] == "succeeded"
        assert {(f.state, f.version) for f in FAKES.values()} == {("RUNNING", "v0")}
        assert svc.status()["window"] is None and svc.journal.alias("last_good") == svc.journal.checkpoint_by_version("v0")
    finally:
        svc.stop()

def test_a_new_versions_rollout_that_moved_no_worker_is_still_finished_at_start(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    rid = _left_open(reg, RolloutTrigger.NEW)
    svc = _service(reg, tmp_path, FakeWorkerClient("w0"), FakeWorkerClient("w1"))
    try:
        row = next(r for r in rollouts(reg) if r["id"] == rid)
        assert row["outcome"] == "succeeded" and row["detail"].get("recovered") is True
        assert {(f.state, f.version) for f in FAKES.values()} == {("RUNNING", "v1")}
    finally:
        svc.stop()


def test_service_refuses_a_worker_kind_that_does_not_take_the_transport(reg: Registry, tmp_path: Path, fake_kind: None) -> None:
    f = FakeWorkerClient("w0")
    f.capabilities = type(f.capabilities)(transports=("disk",))
    FAKES["w0"] = f
    with pytest.raises(ValueError, match=r"\[\[workers\]\] w0: kind 'fake' takes transport 'disk', not \[rollout\].transport = 'ipc'"):
        RolloutService(reg, RolloutSettings(transport="ipc"), [WorkerSpec(name="w0", url="http://fake/w0", kind="fake")],
                       tmp_path)  # fmt: skip


def _wait_status(svc: RolloutService, ckpt_id: int, want: C, timeout: float = 20.0) -> CheckpointRef:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = svc.journal.checkpoint(ckpt_id)
        if row is not None and row.status == want and not svc._busy() and svc.queue.pending is None:
            return row
        time.sleep(0.02)
    raise AssertionError(f"checkpoint {ckpt_id} not {want} (is {svc.journal.checkpoint(ckpt_id)})")


def test_service_retries_a_version_whose_rollout_failed_for_a_crashed_worker(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    """Finding 9: a worker that dies mid-update is not the checkpoint's fault: v1 stays verified,
    is rolled out again once the worker is back on v0, and ends serving."""
    w1 = FakeWorkerClient("w1")
    svc = _service(reg, tmp_path, FakeWorkerClient("w0"), w1)
    try:
        v0 = verified(reg, "v0")
        svc.journal.set_alias("serving", v0.id)
        svc.journal.set_alias("last_good", v0.id)
        v1 = verified(reg, "v1")
        w1.fail("update", crash=True)
        svc.submit(v1.id)
        row = _wait_status(svc, v1.id, C.DEPLOYED)
        assert row.status == C.DEPLOYED
        outcomes = [(r["outcome"], r["detail"].get("kind")) for r in rollouts(reg) if r["version"] == "v1"]
        assert outcomes == [("failed", "unreachable"), ("succeeded", None)]
        assert {(f.state, f.version) for f in FAKES.values()} == {("RUNNING", "v1")}
        assert svc.journal.alias("serving") == svc.journal.checkpoint(v1.id)
    finally:
        svc.stop()


def test_service_gives_up_on_a_version_that_keeps_crashing_a_worker(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    """The retries are bounded: after max_infra_retries more crashes the version is rejected."""
    w1 = FakeWorkerClient("w1")
    svc = _service(reg, tmp_path, FakeWorkerClient("w0"), w1, max_infra_retries=2)
    try:
        v0 = verified(reg, "v0")
        svc.journal.set_alias("serving", v0.id)
        svc.journal.set_alias("last_good", v0.id)
        v1 = verified(reg, "v1")
        w1.fail("update", crash=True, times=10)
        svc.submit(v1.id)
        row = _wait_status(svc, v1.id, C.REJECTED)
        assert row.status == C.REJECTED
        assert [r["outcome"] for r in rollouts(reg) if r["version"] == "v1"] == ["failed"] * 3
        with reg.session() as s:
            message = s.get(Checkpoint, v1.id).status_message  # type: ignore[union-attr]
        assert message is not None and "gave up after 2 retries" in message
        assert {(f.state, f.version) for f in FAKES.values()} == {("RUNNING", "v0")}
    finally:
        svc.stop()


def test_service_never_deploys_a_lower_step_over_the_serving_one(reg: Registry, tmp_path: Path, fake_kind: None) -> None:
    """Point 11: step-999 verified after step-1000 serves is superseded, not deployed over it."""
    svc = _service(reg, tmp_path, FakeWorkerClient("w0", version="step-1000"))
    try:
        s1000 = verified(reg, "step-1000", step=1000)
        svc.journal.set_alias("serving", s1000.id)
        svc.journal.set_alias("last_good", s1000.id)
        s999 = verified(reg, "step-999", step=999)
        svc.submit(s999.id)
        row = _wait_status(svc, s999.id, C.SUPERSEDED)
        assert row.status == C.SUPERSEDED
        assert FAKES["w0"].version == "step-1000" and "update" not in FAKES["w0"].calls
        s1001 = verified(reg, "step-1001", step=1001)
        svc.submit(s1001.id)
        assert _wait_status(svc, s1001.id, C.DEPLOYED).status == C.DEPLOYED
        assert FAKES["w0"].version == "step-1001"
    finally:
        svc.stop()


WINDOW = {"health_window_s": 0.05, "health_sample_s": 0.01, "health_probe_s": 0.0}


def test_the_runner_steps_an_open_window_and_the_job_ends_with_its_verdict(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    """A new version's window is a condition the runner steps, not a wait inside the job: while it
    is open the job is `current` and its Future waits; an operator's rollback queued meanwhile ends
    it (aborted: v1 not last_good) and runs next; the job's answer carries the window's verdict."""
    from daemon.controller.commands import Deploy, Rollback

    svc = _service(reg, tmp_path, FakeWorkerClient("w0"), health_window_s=60.0, health_sample_s=0.05,
                   health_probe_s=0.0)  # fmt: skip
    try:
        v0 = verified(reg, "v0")
        svc.journal.set_alias("serving", v0.id)
        svc.journal.set_alias("last_good", v0.id)
        job = Deploy(verified(reg, "v1"))
        deployed = svc.queue.command(job)
        wait_until(lambda: svc.decisions.window is not None, 20, what="v1's window open")
        assert svc.status()["current"] == "deploy v1" and svc.status()["serving"] == "v1" and not deployed.done()
        window = svc.status()["window"]
        assert window["version"] == "v1" and window["seconds"] == 60.0 and 0 < window["left_s"] <= 60, window
        back = svc.queue.command(Rollback(to="v0"))
        assert deployed.result(20)["health_window"] == "aborted"
        assert back.result(20)["outcome"] == "succeeded" and FAKES["w0"].version == "v0"
        assert svc.journal.alias("last_good") == svc.journal.checkpoint(v0.id) and svc.status()["window"] is None
    finally:
        svc.stop()


def test_a_fleet_converge_never_deploys_a_version_rejected_since_it_was_asked(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    """The fleet agent asked to converge to v1 while this host's own deploy of v1 ran; v1's window
    then failed here (rejected, the stage halted). The queued converge must not put v1 back (seen
    in CI: the canary redeployed it and the other hosts followed). An operator's pin --force may."""
    from daemon.controller.queue import CommandError

    svc = _service(reg, tmp_path, FakeWorkerClient("w0", version="v0"))
    try:
        v0, v1 = verified(reg, "v0"), verified(reg, "v1")
        svc.journal.set_alias("serving", v0.id)
        svc.journal.set_alias("last_good", v0.id)
        svc.journal.move_status(v1.id, C.REJECTED, "rolled back to v0 after deploy: gate worker-5xx failed")
        with pytest.raises(CommandError, match="was rejected .* a fleet converge does not deploy it"):
            svc.converge("v1").result(20)
        assert FAKES["w0"].version == "v0" and svc.journal.alias("serving") == svc.journal.checkpoint(v0.id)
        assert svc.pin("v1", force=True).result(20)["outcome"] == "succeeded" and FAKES["w0"].version == "v1"
    finally:
        svc.stop()


def _stopped_inside_v1s_window(reg: Registry) -> tuple[CheckpointRef, CheckpointRef]:
    """The registry of a daemon that stopped inside v1's health window: v1 serves, v0 is last_good."""
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    j = Journal(reg)
    j.serve(v1.id, [(v1.id, C.DEPLOYED, "serving on every worker")])
    j.set_alias("last_good", v0.id)
    rid = j.start_rollout(v1.id, trigger=RolloutTrigger.NEW, transport="disk", mode="drain", detail={})
    j.finish_rollout(rid, RolloutOutcome.SUCCEEDED)
    return v0, v1


@pytest.mark.parametrize("operator", [False, True])
def test_a_window_the_daemon_stopped_inside_is_watched_again_as_its_first_job(
    reg: Registry, tmp_path: Path, fake_kind: None, operator: bool
) -> None:
    """Start-up queues the interrupted window as the first job instead of watching it before the
    daemon is ready: it passes (v1 last_good), or an operator's rollback, taken at once, ends it."""
    v0, v1 = _stopped_inside_v1s_window(reg)
    svc = _service(reg, tmp_path, FakeWorkerClient("w0", version="v1"), health_window_s=60.0 if operator else 0.3,
                   health_sample_s=0.05, health_probe_s=0.0)  # ready at once, not after the window  # fmt: skip
    try:
        if not operator:
            wait_until(lambda: svc.journal.alias("last_good") == svc.journal.checkpoint(v1.id), 20, what="v1 last good")
            assert svc.journal.alias("serving") == svc.journal.checkpoint(v1.id)
            return
        wait_until(lambda: svc.status()["window"] is not None, 20, what="v1's window open again")
        assert svc.status()["current"] == "health window v1" and svc.status()["window"]["version"] == "v1"
        assert svc.rollback(to="v0").result(20)["outcome"] == "succeeded"
        assert FAKES["w0"].version == "v0" and svc.journal.alias("last_good") == svc.journal.checkpoint(v0.id)
        assert svc.status()["window"] is None
    finally:
        svc.stop()


def test_a_worker_dying_in_the_health_window_rolls_back_and_retries_the_version(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    """A worker that stops answering during v1's health window is the fleet's fault as much as a
    crash mid-rollout: the fleet goes back to v0, v1 returns to verified and is rolled out again."""
    w1 = FakeWorkerClient("w1")
    svc = _service(reg, tmp_path, FakeWorkerClient("w0"), w1, **WINDOW)
    try:
        v0 = verified(reg, "v0")
        svc.journal.set_alias("serving", v0.id)
        svc.journal.set_alias("last_good", v0.id)
        v1 = verified(reg, "v1")
        w1.fail("counters", crash=True)  # dies as the window starts
        svc.submit(v1.id)
        wait_until(lambda: svc.journal.alias("last_good") == svc.journal.checkpoint(v1.id), 20, what="v1 last good")
        outcomes = [r["outcome"] for r in rollouts(reg) if r["version"] == "v1"]
        assert outcomes == ["rolled_back", "succeeded"], outcomes
        assert [r["detail"]["by"] for r in rollouts(reg) if r["version"] == "v0"] == ["health_window"]
        assert {(f.state, f.version) for f in FAKES.values()} == {("RUNNING", "v1")}
        with reg.session() as s:
            states = [e.to_state for e in s.query(Event).filter(Event.checkpoint_id == v1.id, Event.worker.is_(None))]
        assert "rejected" not in states and states.count("deployed") == 2, states
    finally:
        svc.stop()


def test_a_version_that_keeps_killing_a_worker_in_its_health_window_is_rejected(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    w1 = FakeWorkerClient("w1")
    svc = _service(reg, tmp_path, FakeWorkerClient("w0"), w1, max_infra_retries=1, **WINDOW)
    try:
        v0 = verified(reg, "v0")
        svc.journal.set_alias("serving", v0.id)
        svc.journal.set_alias("last_good", v0.id)
        v1 = verified(reg, "v1")
        w1.fail("counters", crash=True, times=10)
        svc.submit(v1.id)
        row = _wait_status(svc, v1.id, C.REJECTED)
        assert row.status == C.REJECTED
        assert [r["outcome"] for r in rollouts(reg) if r["version"] == "v1"] == ["rolled_back", "rolled_back"]
        with reg.session() as s:
            message = s.get(Checkpoint, v1.id).status_message  # type: ignore[union-attr]
        assert message is not None and "gave up after 1 retries" in message and "did not answer" in message
        assert {(f.state, f.version) for f in FAKES.values()} == {("RUNNING", "v0")}
    finally:
        svc.stop()


class PreparingFake(FakeWorkerClient):
    """A fake that can prepare (like the reference worker's /admin/prepare); the log is shared."""

    def __init__(self, name: str, log: list[str], **kw: Any) -> None:
        super().__init__(name, **kw)
        self.log = log
        self.prepared: str | None = None
        self.gate: Any = None  # a threading.Event this worker's update waits for (10 s at most)

    def prepare(self, request: Any) -> None:
        self.log.append(f"{self.name}.prepare {request.version}")
        self.prepared = request.version

    def pause(self, mode: Any = "keep") -> None:
        self.log.append(f"{self.name}.pause")
        super().pause(mode)

    def drain(self, timeout_s: float) -> None:
        self.log.append(f"{self.name}.pause")  # leaves RUNNING all the same
        super().drain(timeout_s)

    def update(self, request: Any) -> Any:
        if self.gate is not None:
            self.gate.wait(10)
        self.log.append(f"{self.name}.update {request.version} prepared={self.prepared == request.version}")
        self.prepared = None
        return super().update(request)


def test_later_workers_are_prepared_while_the_first_updates_and_each_is_prepared_once(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    import threading

    log: list[str] = []
    w0, w1 = PreparingFake("w0", log), PreparingFake("w1", log)
    w0.gate = threading.Event()  # w0's update waits until w1 was prepared: only prepared-ahead passes
    orig = w1.prepare

    def prepare_then_open_gate(request: Any) -> None:
        orig(request)
        w0.gate.set()

    w1.prepare = prepare_then_open_gate  # type: ignore[method-assign]
    svc = _service(reg, tmp_path, w0, w1, max_unavailable=1)  # two batches: w0, then w1
    try:
        v0 = verified(reg, "v0")
        svc.journal.set_alias("serving", v0.id)
        svc.journal.set_alias("last_good", v0.id)
        out = svc.decisions.deploy_new(verified(reg, "v1"))
        assert out["outcome"] == "succeeded", out
        assert log.index("w1.prepare v1") < log.index("w0.update v1 prepared=True"), log
        assert log.index("w1.prepare v1") < log.index("w1.pause"), log
        assert log.count("w1.prepare v1") == 1 and log.count("w0.prepare v1") == 1, log  # not again at its turn
        assert "w1.update v1 prepared=True" in log, log
        assert {f.version for f in (w0, w1)} == {"v1"}
    finally:
        svc.stop()


def test_a_worker_already_on_the_target_is_not_prepared_ahead(reg: Registry, tmp_path: Path, fake_kind: None) -> None:
    log: list[str] = []
    w0, w1 = PreparingFake("w0", log), PreparingFake("w1", log, version="v1")
    svc = _service(reg, tmp_path, w0, w1, max_unavailable=1)
    try:
        v0 = verified(reg, "v0")
        svc.journal.set_alias("serving", v0.id)
        svc.journal.set_alias("last_good", v0.id)
        assert svc.decisions.deploy_new(verified(reg, "v1"))["outcome"] == "succeeded"
        assert not [e for e in log if e.startswith("w1.")], log  # nothing opened that no update takes
    finally:
        svc.stop()


# -- issue 21: nothing left out of rotation ------------------------------------------------------


def test_a_rollback_to_a_version_the_worker_refuses_leaves_it_serving_what_it_had(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    """The reported outage: the one worker refused the rollback target (a byte changed since
    verify) and was left DRAINING. Now it resumes on what it served, the rollout fails with the
    reason, and the fallback of an operator rollback is the serving version, not the target."""
    w0 = FakeWorkerClient("w0", version="v1")
    svc = _service(reg, tmp_path, w0)
    try:
        v0, v1 = verified(reg, "v0"), verified(reg, "v1")
        for v in (v0, v1):
            svc.journal.move_status(v.id, C.DEPLOYED, "served once")
        svc.journal.move_status(v0.id, C.RETIRED, "rolled forward")
        svc.journal.set_alias("serving", v1.id)
        svc.journal.set_alias("last_good", v1.id)
        changed = "model.safetensors changed since it was verified (nothing was loaded)"
        w0.fail("update", UpdateRefused(f"worker w0: update: {changed}"), times=5)
        out = svc.decisions.rollback("v0")
        assert out["outcome"] == "failed" and changed in out["reason"], out
        assert (w0.state, w0.version) == ("RUNNING", "v1")
        path = [(e["from"], e["to"], e["detail"].get("action") or "") for e in worker_events(reg, out["rollout_id"])]
        assert path == [("RUNNING", "PAUSED", ""), ("PAUSED", "RUNNING", "refused")], path  # its group's only worker: paused
        assert svc.journal.alias("serving") == svc.journal.checkpoint(v1.id)
        assert svc.fleet["w0"].state == WorkerState.RUNNING
    finally:
        svc.stop()


def test_an_operator_rollback_never_shows_no_version_deployed_nor_serving_on_one_not_deployed(
    reg: Registry, tmp_path: Path, fake_kind: None
) -> None:
    """The target's `deployed`, the rolled-back version's `retired` and the serving alias commit
    together (before, the retire committed first: a reader between saw nothing deployed)."""
    w0 = FakeWorkerClient("w0", version="v1")
    svc = _service(reg, tmp_path, w0)
    reader = Journal(Registry(reg.url))
    seen: list[tuple[str | None, dict[str, str]]] = []
    try:
        v0, v1 = verified(reg, "v0"), verified(reg, "v1")
        for v in (v0, v1):
            svc.journal.move_status(v.id, C.DEPLOYED, "served once")
        svc.journal.move_status(v0.id, C.RETIRED, "rolled forward")
        svc.journal.set_alias("serving", v1.id)
        svc.journal.set_alias("last_good", v1.id)

        def look(_s: object) -> None:  # after each commit, in the committing thread
            with reader.registry.session() as s:
                statuses = {c.version: c.status for c in s.scalars(select(Checkpoint))}
            serving = reader.alias("serving")
            seen.append((serving.version if serving else None, statuses))

        reg.listen("after_commit", look)
        out = svc.decisions.rollback("v0")
        assert out["outcome"] == "succeeded", out
        assert seen[-1] == ("v0", {"v0": "deployed", "v1": "retired"}), seen[-1]
        assert all(list(st.values()).count("deployed") == 1 for _v, st in seen), seen
        assert all(st[v] == "deployed" for v, st in seen if v), seen
        with reg.session() as s:
            assert s.get(Checkpoint, v1.id).status_message == "rolled back by operator to v0"  # type: ignore[union-attr]
    finally:
        svc.stop()
        reader.registry.close()


def test_a_worker_whose_fallback_cannot_be_installed_goes_back_on_its_intact_weights(
    reg: Registry, tmp_path: Path
) -> None:
    w0 = FakeWorkerClient("w0", version="v1")
    r = rig(reg, tmp_path, w0)
    v0, v1, v2 = verified(reg, "v0"), verified(reg, "v1"), verified(reg, "v2")
    del v1
    w0.fail("update", WorkerError("worker w0: update: HTTP 500: boom"))  # nothing written, not a refusal
    w0.fail("rollback", WorkerError("worker w0: update: v0's files changed since verify"))  # the fallback fails too
    res = r.deploy(v2, v0)
    assert res.outcome == RolloutOutcome.FAILED and res.unrecovered == []
    assert (w0.state, w0.version) == ("RUNNING", "v1") and r.restarts.done == []
    (last,) = [e for e in worker_events(reg, res.rollout_id)][-1:]
    assert (last["to"], last["detail"]["how"], last["detail"]["restored_to"]) == ("RUNNING", "kept its intact weights", "v1")


def test_a_worker_that_cannot_be_restarted_is_never_said_to_be_restarting(reg: Registry, tmp_path: Path) -> None:
    w0 = FakeWorkerClient("w0", version="v1")
    r = rig(reg, tmp_path, w0)
    r.restarts.refuse.add("w0")
    v0, v2 = verified(reg, "v0"), verified(reg, "v2")
    w0.fail("update", WorkerError("worker w0: update: HTTP 500: write failed"), partial=True)  # weights a mix
    w0.fail("rollback", WorkerError("worker w0: update: refused"), times=5)
    res = r.deploy(v2, v0)
    assert res.unrecovered == ["w0"]
    events = worker_events(reg, res.rollout_id)
    assert [e["detail"].get("action") for e in events][-1] == "not_restarted", events
    row = worker_row(reg, "w0")
    assert "restarting" not in (row["last_error"] or "") and "not restarted" in row["last_error"], row


def test_a_worker_found_running_where_its_last_move_went_unrecorded_is_recorded_running(
    reg: Registry, tmp_path: Path
) -> None:
    """The fault matrix's PostgreSQL outage: w0's UPDATED was recorded, the outage cut the rollout
    short before its RUNNING was, and the service resumed it. The next rollout finds it RUNNING on
    the target: the `workers` row must say so too, not keep UPDATED for ever."""
    r = rig(reg, tmp_path, FakeWorkerClient("w0"), FakeWorkerClient("w1"))
    v0, v1, v2 = verified(reg, "v0"), verified(reg, "v1"), verified(reg, "v2")
    assert r.deploy(v1, v0).outcome == RolloutOutcome.SUCCEEDED
    h, w0 = r.fleet["w0"], r.fakes["w0"]
    r.driver.move(h, None, S.DRAINING, duration_ms=None)
    r.driver.move(h, None, S.UPDATED, duration_ms=None, version="v2")
    w0.version = "v2"  # what the worker serves after the service resumed it; nothing recorded that
    assert worker_row(reg, "w0")["state"] == "UPDATED"
    res = r.deploy(v2, v1)
    assert res.outcome == RolloutOutcome.SUCCEEDED and res.moved == ["w1"], res
    row = worker_row(reg, "w0")
    assert (row["state"], row["weight_version"]) == ("RUNNING", "v2"), row
    observed = [e for e in worker_events(reg, res.rollout_id) if e["worker"] == "w0"]
    assert [(e["from"], e["to"], e["detail"].get("observed")) for e in observed] == [("UPDATED", "RUNNING", True)]
