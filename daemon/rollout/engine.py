"""A rolling update of the whole fleet to one checkpoint, and its failure path.

`deploy` opens a `rollouts` row, prepares the transport (the loader stages the
version before any worker leaves RUNNING), then walks the plan's batches. When a
worker fails a step it is restored to the fallback version (or restarted), every
worker this rollout already moved is rolled back to the fallback too, and only
then is the rollout closed as `failed`: no mixed versions after a failed rollout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from daemon.adapters.base import PreparesUpdates, WorkerError
from daemon.config import RolloutMode, RolloutSettings
from daemon.logging import get_logger
from daemon.registry.journal import CheckpointRef, Journal
from daemon.registry.status import CheckpointStatus, FailureKind, RolloutOutcome, RolloutTrigger
from daemon.rollout.driver import StepFailed, WorkerDriver
from daemon.rollout.planner import Batch, modes_of, plan
from daemon.rollout.stage import StageError, Stager, Target
from daemon.rollout.states import FAILED, Fleet, WorkerHandle, WorkerState, parse_state

log = get_logger(__name__)


@dataclass
class RolloutResult:
    rollout_id: int
    outcome: RolloutOutcome  # succeeded | failed | superseded
    reason: str | None = None
    moved: list[str] = field(default_factory=list)  # workers this rollout put on the target
    unrecovered: list[str] = field(default_factory=list)  # workers left UNHEALTHY after a failure
    kind: FailureKind | None = None  # of the failure


class RolloutEngine:
    def __init__(self, journal: Journal, fleet: Fleet, settings: RolloutSettings, driver: WorkerDriver, stager: Stager):
        self.journal = journal
        self.fleet = fleet
        self.settings = settings
        self.driver = driver
        self.stager = stager

    def deploy(
        self,
        ckpt: CheckpointRef,
        *,
        trigger: RolloutTrigger,
        fallback: CheckpointRef | None,
        should_yield: Callable[[], bool] = lambda: False,
        only: Collection[str] | None = None,
        detail: dict[str, Any] | None = None,
    ) -> RolloutResult:
        batches = plan(self.fleet.specs, self.settings, only)
        rid = self.journal.start_rollout(
            ckpt.id,
            trigger=trigger,
            transport=self.stager.transport,
            mode=modes_of(batches),
            detail={
                "version": ckpt.version,
                "fallback": fallback.version if fallback else None,
                "workers": [w for b in batches for w in b.workers],
                "update_mode": self.settings.update_mode,
                **(detail or {}),
            },
        )
        log.info("rollout_started", rollout=rid, version=ckpt.version, trigger=trigger, fallback=str(fallback))
        try:
            target = self.stager.target(ckpt)
        except StageError as exc:
            self.journal.finish_rollout(rid, RolloutOutcome.FAILED, {"reason": str(exc), "step": "stage"})
            log.warning("rollout_failed", rollout=rid, version=ckpt.version, reason=str(exc))
            return RolloutResult(rid, RolloutOutcome.FAILED, str(exc))
        if ckpt.status == CheckpointStatus.VERIFIED and target.staged:
            self.journal.move_status(ckpt.id, CheckpointStatus.STAGED, f"staged by {self.stager.transport} for rollout {rid}")

        unavailable = self._preflight(rid, ckpt, fallback, [w for b in batches for w in b.workers])
        if unavailable:
            reason = f"worker {', '.join(unavailable)} not available before the rollout and could not be restored"
            self.journal.finish_rollout(
                rid, RolloutOutcome.FAILED,
                {"reason": reason, "kind": FailureKind.UNAVAILABLE.value, "step": "preflight", "unrecovered": unavailable},
            )  # fmt: skip
            log.warning("rollout_failed", rollout=rid, version=ckpt.version, reason=reason)
            return RolloutResult(rid, RolloutOutcome.FAILED, reason, unrecovered=unavailable, kind=FailureKind.UNAVAILABLE)

        moved: list[tuple[WorkerHandle, RolloutMode]] = []
        drained_last = False  # the previous batch took a worker out of a load balancer's rotation
        with PreparedAhead(self.driver, self.fleet, batches[1:], target) as ahead:
            for batch in batches:
                if drained_last and batch.mode == "drain":
                    # the workers just resumed are ready, but a load balancer sees that only at its
                    # next health check: draining the next batch now could leave it none to send to
                    time.sleep(self.settings.rejoin_s)
                if should_yield():
                    names = [h.name for h, _ in moved]
                    self.journal.finish_rollout(rid, RolloutOutcome.SUPERSEDED, {"moved": names})
                    log.info("rollout_superseded", rollout=rid, version=ckpt.version, moved=names)
                    return RolloutResult(rid, RolloutOutcome.SUPERSEDED, "stopped at a batch boundary for newer work",
                                         moved=names)  # fmt: skip
                outcomes = self._run_batch(batch, rid, target, ahead)
                moved += [(h, batch.mode) for h, changed, failure in outcomes if failure is None and changed]
                drained_last = batch.mode == "drain" and any(changed for _, changed, _ in outcomes)
                failures = [(h, f) for h, _, f in outcomes if f is not None]
                if failures:
                    ahead.close()  # no preparation lands after the failure path has begun
                    return self._fail(rid, ckpt, fallback, failures, moved)
        names = [h.name for h, _ in moved]
        self.journal.finish_rollout(rid, RolloutOutcome.SUCCEEDED, {"moved": names})
        log.info("rollout_succeeded", rollout=rid, version=ckpt.version, moved=names)
        return RolloutResult(rid, RolloutOutcome.SUCCEEDED, moved=names)

    def _preflight(self, rid: int, ckpt: CheckpointRef, fallback: CheckpointRef | None, names: list[str]) -> list[str]:
        """Before any worker leaves RUNNING: a worker that is down or stuck is brought back on the
        fallback first (restore, else restart), so a dead worker is not blamed on the new version.
        Returns the workers that could not be brought back (the rollout then does not start)."""
        fb: Target | None = None
        unavailable: list[str] = []
        for name in names:
            h = self.fleet[name]
            with h.busy:
                try:
                    info = h.client.weight_info()
                    reported = parse_state(info.state)
                    if reported == WorkerState.RUNNING:
                        h.observed(WorkerState.RUNNING)
                        continue
                    problem = f"worker reports state {info.state!r}"
                    if reported is not None:
                        h.observed(reported)
                except WorkerError as exc:
                    problem = str(exc)
                fb = fb or self.fallback_target(fallback)
                if h.state not in FAILED:
                    h.observed(h.state or WorkerState.RUNNING)
                    self.driver.move(h, rid, WorkerState.UNHEALTHY, duration_ms=None,
                                     detail={"step": "preflight", "error": problem}, error=problem)  # fmt: skip
                why = f"not available before the rollout of {ckpt.version}: {problem}"
                if not self.driver.recover(h, rid, why, fb, ckpt.version):
                    unavailable.append(name)
        return unavailable

    def _run_batch(
        self, batch: Batch, rid: int, target: Target, ahead: PreparedAhead | None = None
    ) -> list[tuple[WorkerHandle, bool, StepFailed | None]]:
        def one(name: str) -> tuple[WorkerHandle, bool, StepFailed | None]:
            h = self.fleet[name]
            prepared = ahead is not None and ahead.wait(name)
            with h.busy:
                try:
                    return h, self.driver.update(h, rid, target, batch.mode, prepare=not prepared), None
                except StepFailed as exc:
                    log.warning("worker_step_failed", rollout=rid, worker=name, step=exc.step, reason=exc.reason)
                    return h, False, exc

        if len(batch.workers) == 1:
            return [one(batch.workers[0])]
        with ThreadPoolExecutor(max_workers=len(batch.workers), thread_name_prefix="rollout") as pool:
            return list(pool.map(one, batch.workers))

    def fallback_target(self, fallback: CheckpointRef | None, exclude: Collection[int] = ()) -> Target | None:
        """The request for `fallback`; when it cannot be offered (its files are gone or changed
        size), the newest other version that served and can be. None when there is none: workers
        then keep (or restore by themselves) what they have instead of being moved onto missing files."""
        if fallback is None:
            return None
        if fallback.id not in exclude:
            try:
                return self.stager.target(fallback)
            except StageError as exc:
                log.error("fallback_unavailable", version=fallback.version, error=str(exc))
        for other in self.journal.good_versions(exclude_ids=[fallback.id, *exclude]):
            try:
                target = self.stager.target(other)
            except StageError as exc:
                log.warning("fallback_candidate_unavailable", version=other.version, error=str(exc))
                continue
            log.warning("fallback_replaced", wanted=fallback.version, using=other.version)
            return target
        return None

    def _fail(
        self,
        rid: int,
        ckpt: CheckpointRef,
        fallback: CheckpointRef | None,
        failures: list[tuple[WorkerHandle, StepFailed]],
        moved: list[tuple[WorkerHandle, RolloutMode]],
    ) -> RolloutResult:
        first = failures[0][1]
        why = f"rollout of {ckpt.version} failed: {first}"
        fb = self.fallback_target(fallback)
        unrecovered: list[str] = []
        # 1. The failed workers: restore over the admin API, else restart.
        for h, _ in failures:
            with h.busy:
                if not self.driver.recover(h, rid, why, fb, ckpt.version):
                    unrecovered.append(h.name)
        # 2. Everyone this rollout already moved goes back too: no mixed versions.
        for h, mode in reversed(moved):
            with h.busy:
                try:
                    if fb is not None:
                        self.driver.update(h, rid, fb, mode, back=True)
                    else:
                        self.driver.revert(h, rid, mode)
                except StepFailed as exc:
                    log.warning("rollback_step_failed", rollout=rid, worker=h.name, reason=exc.reason)
                    if not self.driver.recover(h, rid, f"{why}; rolling back: {exc}", fb, ckpt.version):
                        unrecovered.append(h.name)
        detail = {
            "reason": str(first),
            "worker": first.worker,
            "step": first.step,
            "kind": first.kind.value,
            "restored_to": fb.version if fb else "worker's previous version",
            "rolled_back": [h.name for h, _ in moved],
            "unrecovered": unrecovered,
        }
        self.journal.finish_rollout(rid, RolloutOutcome.FAILED, detail)
        log.warning("rollout_failed", rollout=rid, version=ckpt.version, **detail)
        return RolloutResult(rid, RolloutOutcome.FAILED, str(first), moved=[], unrecovered=unrecovered, kind=first.kind)


class PreparedAhead:
    """Prepare (open, read ahead and check) the workers of the later batches while the first
    batch updates, so each later worker's turn starts with its source already open: on the disk
    transport a prepare reads and hashes the whole version (~1.1 s for 8B on an H200), which was
    paid once per worker, one after the other (issue 15). A worker already on the target, or
    not RUNNING, is left to its own turn (which checks and prepares it as before)."""

    def __init__(self, driver: WorkerDriver, fleet: Fleet, later: list[Batch], target: Target) -> None:
        self.driver, self.fleet, self.target = driver, fleet, target
        names = [n for b in later for n in b.workers if isinstance(fleet[n].client, PreparesUpdates)]
        self._pool = ThreadPoolExecutor(max_workers=len(names), thread_name_prefix="prepare") if names else None
        self._futures: dict[str, Future[bool]] = {}
        if self._pool is not None:
            self._futures = {n: self._pool.submit(self._prepare, n) for n in names}

    def _prepare(self, name: str) -> bool:
        h = self.fleet[name]
        with h.busy:  # the health poll never sees a worker the engine is driving
            try:
                info = h.client.weight_info()
            except WorkerError:
                return False
            if parse_state(info.state) != WorkerState.RUNNING or self.target.matches(info):
                return False
            return self.driver.prepare(h, self.target)

    def wait(self, name: str) -> bool:
        """True when `name` was prepared ahead for this target (its update then skips preparing)."""
        fut = self._futures.get(name)
        if fut is None:
            return False
        try:
            return fut.result()
        except Exception as exc:  # noqa: BLE001 - best effort, as the driver's own prepare
            log.warning("prepare_ahead_failed", worker=name, error=str(exc))
            return False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> PreparedAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
