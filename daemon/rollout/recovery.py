"""Crash recovery: on start, finish or undo what a killed daemon left in flight.

For an unfinished rollout the daemon asks every worker's `/weight_info` and:
- finishes it (every worker to the rollout's version) when no worker had failed yet;
- undoes it (every worker to the fallback version) when its failure path had begun.
A worker is picked up in the state it reports: DRAINING/PAUSED continue with the
transfer, UPDATED with the post-check, UNHEALTHY or silent ones are restored or
restarted. The transitions the daemon did not live to record are written first
(marked `observed`), so the history has no gaps. The rollout row is then closed.

Drift (issue 10, finding 4): on every health poll, each RUNNING worker's report (version,
digest, and for the disk transport the directory it loaded) is compared with the registry's record of that version. Anything that
does not match, e.g. another process loaded its own weights into the worker under the real
version label, is drift: the worker moves to UNCERTAIN (an `events` row with what differed), an
alert is logged, and it stays UNCERTAIN, whatever it reports, until the daemon has re-installed a
known version on it (the reconcile job: `recover_uncertain`). A version the registry does not
know is not judged here: it is version drift, which the reconcile job corrects anyway.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from daemon.common import get_logger
from daemon.config import RolloutMode
from daemon.engines import WeightInfo, WorkerError
from daemon.registry import CheckpointRef, Journal, RolloutRef
from daemon.rollout.driver import StepFailed, WorkerDriver
from daemon.rollout.engine import RolloutEngine
from daemon.rollout.failure import FailurePath
from daemon.rollout.stage import Target
from daemon.rollout.states import ALLOWED, FAILED, WorkerHandle, WorkerState, parse_state

log = get_logger(__name__)
S = WorkerState


@dataclass
class Recovered:
    rollout_id: int
    version: str  # where every worker was brought
    finished: bool  # True: the rollout was completed; False: it was undone
    unrecovered: list[str]


def fleet_version(fleet: Iterable[WorkerHandle]) -> str | None:
    """The one version every worker reports serving (RUNNING), else None: what `serving` may
    record after a rollback that did not go as planned."""
    versions: set[str | None] = set()
    for h in fleet:
        try:
            info = h.client.weight_info()
        except WorkerError:
            return None
        if parse_state(info.state) != S.RUNNING:
            return None
        versions.add(info.version)
    return versions.pop() if len(versions) == 1 else None


class Recovery:
    def __init__(self, journal: Journal, engine: RolloutEngine, driver: WorkerDriver) -> None:
        self.journal = journal
        self.engine = engine
        self.driver = driver
        self.failure = FailurePath(driver)

    def run(self, rollout: RolloutRef, fallback: CheckpointRef | None) -> Recovered:
        failed_before = self.journal.rollout_had_failure(rollout.id)
        # Forward when nothing had failed yet (the version was verified); back when the failure
        # path had begun, since that path's promise is "everyone on the fallback".
        finish = not failed_before or fallback is None
        goal_ckpt = rollout.checkpoint if finish else fallback
        assert goal_ckpt is not None
        log.warning(
            "recovering_rollout",
            rollout=rollout.id,
            version=rollout.checkpoint.version,
            action="finish" if finish else "undo",
            goal=goal_ckpt.version,
        )
        goal = self.engine.fallback_target(goal_ckpt)
        fb = self.engine.fallback_target(fallback) if fallback else None
        why = f"daemon restarted during rollout {rollout.id} ({'finishing' if finish else 'undoing'} it)"
        unrecovered: list[str] = []
        modes: dict[str, RolloutMode] = {name: b.mode for b in self.engine.plan() for name in b.workers}
        for h in self.engine.fleet:
            with h.drive():
                if not self._bring(h, rollout.id, goal, fb, modes.get(h.name, "drain"), why):
                    unrecovered.append(h.name)
        return Recovered(rollout.id, goal_ckpt.version, finish, unrecovered)

    def _bring(
        self, h: WorkerHandle, rid: int, goal: Target | None, fallback: Target | None, mode: RolloutMode, why: str
    ) -> bool:
        """Take one worker from whatever state it is in to RUNNING on `goal`. False if it stays UNHEALTHY."""
        recorded, _ = self.journal.worker_state(h.name)
        h.observed(parse_state(recorded))
        try:
            info: WeightInfo | None = h.client.weight_info()
        except WorkerError:
            info = None
        observed = parse_state(info.state) if info else None
        try:
            if info is None or observed is None:
                h.observed(h.state or S.RUNNING)
                if h.state not in FAILED:
                    self.driver.move(
                        h, rid, S.UNHEALTHY, duration_ms=None, detail={"observed": True, "why": why, "answer": None if info is None else info.state},
                        error="no usable answer from the worker after the daemon restarted",
                    )
                return self.failure.recover(h, rid, why, goal or fallback)
            if h.state is None:
                # nothing recorded that we could contradict: record what it reports now, so the
                # registry shows the worker from the first pass, not from the next health poll
                self.journal.observe(h.name, state=observed.value, weight_version=info.version, error=None, device=info.device)
                h.observed(observed)
            elif observed != h.state:
                if observed in ALLOWED[h.state]:
                    self.driver.move(h, rid, observed, duration_ms=None, detail={"observed": True, "why": why},
                                     version=info.version)  # fmt: skip
                else:
                    self.driver.move(
                        h, rid, S.UNHEALTHY, duration_ms=None,
                        detail={"observed": observed.value, "recorded": h.state.value, "why": why},
                        error=f"worker reports {observed.value}, the daemon last recorded {h.state.value}",
                    )  # fmt: skip
                    return self.failure.recover(h, rid, why, goal or fallback)
            if goal is None:
                raise StepFailed(h.name, "recover", "the version to recover to has no local copy")
            if h.state == S.RUNNING:
                if not goal.matches(info):
                    self.driver.update(h, rid, goal, mode)
                return True
            if h.state in (S.DRAINING, S.PAUSED):
                self.driver.transfer(h, rid, goal)
                self.driver.finish(h, rid, goal, {"recovered": True})
                return True
            if h.state == S.UPDATED:
                if goal.matches(info):
                    self.driver.finish(h, rid, goal, {"recovered": True})
                    return True
                self.driver.move(h, rid, S.UNHEALTHY, duration_ms=None,
                                 detail={"why": f"{why}: undoing the update to {info.version}"})  # fmt: skip
            return self.failure.recover(h, rid, why, goal)
        except StepFailed as exc:
            # The driver already recorded -> UNHEALTHY for the failed step.
            return self.failure.recover(h, rid, f"{why}: {exc}", fallback or goal)


# -- drift: what a worker reports against the registry ---------------------------------------


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def drift(info: WeightInfo, ckpt: CheckpointRef | None) -> str | None:
    """One line naming what the worker reports that the registry's record of its version does
    not vouch for; None when it all matches (or the version is not one the registry knows)."""
    if ckpt is None:
        return None
    if ckpt.digest and info.digest and info.digest != ckpt.digest:
        return (f"reports digest {info.digest} for {info.version}; the registry's digest of that "
                f"version is {ckpt.digest}")  # fmt: skip
    path = info.extra.get("path")
    if (info.extra.get("transport") == "disk" and isinstance(path, str) and ckpt.local_path
            and not _same_dir(path, ckpt.local_path)):
        return f"serves {info.version} from {path}; the registry has that version at {ckpt.local_path}"
    return None


def reported(info: WeightInfo) -> dict[str, Any]:
    return {"version": info.version, "digest": info.digest, "path": info.extra.get("path"),
            "transport": info.extra.get("transport")}  # fmt: skip


def check_worker(journal: Journal, driver: WorkerDriver, h: WorkerHandle, info: WeightInfo) -> str | None:
    """Compare one worker's report with the registry; on drift move it to UNCERTAIN (once) and
    alert. Returns the drift (or, for a worker already UNCERTAIN, why it still is), else None."""
    if h.state == S.UNCERTAIN:
        return "UNCERTAIN until a known version is re-installed"
    if parse_state(info.state) != S.RUNNING or not info.version:
        return None
    problem = drift(info, journal.checkpoint_by_version(info.version))
    if problem is None:
        return None
    log.error("worker_identity_drift", worker=h.name, drift=problem, reported=reported(info))
    h.observed(S.RUNNING)  # what it reports now; the drift is recorded from there
    driver.move(h, None, S.UNCERTAIN, duration_ms=None, version=info.version, error=f"drift: {problem}",
                detail={"action": "drift", "drift": problem, "reported": reported(info), "alert": True})  # fmt: skip
    return problem


def recover_uncertain(driver: WorkerDriver, handles: Iterable[WorkerHandle], target: Target | None) -> list[str]:
    """Re-install `target` (the serving version) on every UNCERTAIN worker; the names done."""
    done = []
    for h in handles:
        with h.drive():
            if h.state != S.UNCERTAIN:
                continue
            why = "reconcile: its report did not match the registry"
            if FailurePath(driver).recover(h, None, why, target, None):
                done.append(h.name)
    return done
