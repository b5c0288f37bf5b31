"""A rolling update of the whole fleet to one checkpoint, and its failure path.

`deploy` opens a `rollouts` row, prepares the transport (the loader stages the
version before any worker leaves RUNNING), then walks the plan's batches. When a
worker fails a step it is restored to the fallback version (or restarted), every
worker this rollout already moved is rolled back to the fallback too, and only
then is the rollout closed as `failed`: no mixed versions after a failed rollout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from daemon.common import get_logger
from daemon.config import RolloutMode, RolloutSettings, WorkerSpec
from daemon.engines import PreparesUpdates, WorkerError
from daemon.registry import (
    CheckpointRef,
    CheckpointStatus,
    FailureKind,
    Journal,
    RolloutOutcome,
    RolloutTrigger,
    unreachable,
)
from daemon.rollout.driver import StepFailed, WorkerDriver
from daemon.rollout.failure import FailurePath
from daemon.rollout.planner import Batch, modes_of, pauses_safely, plan
from daemon.rollout.stage import StageError, Stager, Target
from daemon.rollout.states import FAILED, WorkerHandle, WorkerSet, WorkerState, parse_state

log = get_logger(__name__)


@dataclass
class RolloutResult:
    rollout_id: int
    outcome: RolloutOutcome  # succeeded | failed | superseded
    reason: str | None = None
    moved: list[str] = field(default_factory=list)  # workers this rollout put on the target
    unrecovered: list[str] = field(default_factory=list)  # workers left UNHEALTHY after a failure
    kind: FailureKind | None = None  # of the failure


Outcome = tuple[RolloutResult, dict[str, Any]]  # a rollout's result and its `rollouts.detail`


class RolloutEngine:
    def __init__(self, journal: Journal, fleet: WorkerSet, settings: RolloutSettings, driver: WorkerDriver, stager: Stager):
        self.journal = journal
        self.fleet = fleet
        self.settings = settings
        self.driver = driver
        self.failure = FailurePath(driver)
        self.stager = stager
        # after the preflight, before any worker takes the version: what else must hold it first
        # (LoRA adapters re-verified on the new base, daemon.controller.adapter_base.BaseBinding.prepare)
        self.before_workers: Callable[[CheckpointRef], None] | None = None
        self._warned: set[str] = set()  # groups already warned about leaving rotation during updates

    def plan(self, only: Collection[str] | None = None) -> list[Batch]:
        """The planner's batches for this fleet, by what each worker's client can do (a lone
        worker in drain mode is paused when it pauses safely; daemon.rollout.planner). A group
        that will be out of rotation during updates is warned about once per process."""
        def can_pause(spec: WorkerSpec) -> bool:
            return pauses_safely(spec, self.fleet[spec.name].client.capabilities)

        batches = plan(self.fleet.specs, self.settings, only, can_pause)
        for b in batches:
            if b.out_of_rotation and b.group not in self._warned:
                self._warned.add(b.group)
                log.warning("group_out_of_rotation_during_updates", group=b.group, workers=list(b.workers),
                            reason=b.reason)  # fmt: skip
        return batches

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
        batches = self.plan(only)
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
                # a batch whose mode is not its group's (a lone worker paused instead of drained),
                # or that takes its whole group out of rotation, and why
                **({"batch_modes": [{"group": b.group, "workers": list(b.workers), "mode": b.mode, "reason": b.reason}
                                    for b in batches if b.reason]} if any(b.reason for b in batches) else {}),  # fmt: skip
                **(detail or {}),
            },
        )
        log.info("rollout_started", rollout=rid, version=ckpt.version, trigger=trigger, fallback=str(fallback))
        for b in batches:
            if b.reason:
                log.info("batch_mode", rollout=rid, group=b.group, workers=list(b.workers), mode=b.mode, reason=b.reason)
        try:
            target = self.stager.target(ckpt)
        except StageError as exc:
            # the loader dying is not the checkpoint's fault: no worker was touched, retried later
            kind = FailureKind.UNAVAILABLE if exc.infra else None
            self.journal.finish_rollout(rid, RolloutOutcome.FAILED, {"reason": str(exc), "step": "stage",
                                                                     **({"kind": kind.value} if kind else {})})  # fmt: skip
            log.warning("rollout_failed", rollout=rid, version=ckpt.version, reason=str(exc))
            return RolloutResult(rid, RolloutOutcome.FAILED, str(exc), kind=kind)
        if ckpt.status == CheckpointStatus.VERIFIED and target.staged:
            self.journal.move_status(ckpt.id, CheckpointStatus.STAGED, f"staged by {self.stager.transport} for rollout {rid}")

        # Read now, while the database answers: a failure later must restore the workers even
        # when the database has gone meanwhile (their transitions are then kept for later).
        early = self._fallback_early(fallback)
        with self.slot(ckpt, should_yield) as lost:
            if lost is not None:
                result, detail = self._move(rid, ckpt, fallback, batches, target, early,
                                            lambda: should_yield() or lost())  # fmt: skip
            else:
                reason = "stopped while waiting for a fleet lease slot"
                result, detail = RolloutResult(rid, RolloutOutcome.SUPERSEDED, reason), {"reason": reason}
        # recorded once the workers are back in rotation: outside the slot, which other hosts wait for
        used = self.driver.transports.pop(rid, set())  # e.g. "disk": a vLLM without the extension took an ipc version
        transport = "+".join(sorted(used)) if used and used != {self.stager.transport} else None
        self.journal.finish_rollout(rid, result.outcome, detail, transport=transport)
        say = log.warning if result.outcome == RolloutOutcome.FAILED else log.info
        say(f"rollout_{result.outcome.value}", rollout=rid, version=ckpt.version, **detail)
        return result

    @contextmanager
    def slot(self, ckpt: CheckpointRef, stop_waiting: Callable[[], bool]) -> Iterator[Callable[[], bool] | None]:
        """Held while the rollout may take workers out of rotation (preflight, batches, failure
        path). Yields None when it could not be had, else a check that says it was lost since
        (the rollout then stops at the next batch boundary). Here always had and never lost; a
        fleet host waits for a lease slot (daemon.fleet.agent.LeasedEngine)."""
        yield lambda: False

    def _move(self, rid: int, ckpt: CheckpointRef, fallback: CheckpointRef | None, batches: list[Batch],
              target: Target, early: Target | None, should_yield: Callable[[], bool]) -> Outcome:  # fmt: skip
        """Preflight, then the batches: the result and its `rollouts.detail`, not yet recorded."""
        unavailable = self._preflight(rid, ckpt, fallback, [w for b in batches for w in b.workers])
        if unavailable:
            reason = f"worker {', '.join(unavailable)} not available before the rollout and could not be restored"
            detail = {"reason": reason, "kind": FailureKind.UNAVAILABLE.value, "step": "preflight",
                      "unrecovered": unavailable}  # fmt: skip
            return RolloutResult(rid, RolloutOutcome.FAILED, reason, unrecovered=unavailable,
                                 kind=FailureKind.UNAVAILABLE), detail  # fmt: skip
        if self.before_workers is not None:
            try:
                self.before_workers(ckpt)
            except Exception as exc:  # noqa: BLE001 - the rebase after the rollout holds adapters to the base too
                log.error("before_workers_failed", rollout=rid, version=ckpt.version, error=str(exc))

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
                    return RolloutResult(rid, RolloutOutcome.SUPERSEDED, "stopped at a batch boundary for newer work",
                                         moved=names), {"moved": names}  # fmt: skip
                outcomes = self._run_batch(batch, rid, target, ahead)
                moved += [(h, batch.mode) for h, changed, failure in outcomes if failure is None and changed]
                drained_last = batch.mode == "drain" and any(changed for _, changed, _ in outcomes)
                failures = [(h, f) for h, _, f in outcomes if f is not None]
                if failures:
                    ahead.close()  # no preparation lands after the failure path has begun
                    return self._fail(rid, ckpt, fallback, failures, moved, batch, early)
        names = [h.name for h, _ in moved]
        return RolloutResult(rid, RolloutOutcome.SUCCEEDED, moved=names), {"moved": names}

    def _preflight(self, rid: int, ckpt: CheckpointRef, fallback: CheckpointRef | None, names: list[str]) -> list[str]:
        """Before any worker leaves RUNNING: a worker that is down or stuck is brought back on the
        fallback first (restore, else restart), so a dead worker is not blamed on the new version.
        Returns the workers that could not be brought back (the rollout then does not start)."""
        fb: Target | None = None
        unavailable: list[str] = []
        reports = self._reports(names)
        for name in names:
            h = self.fleet[name]
            with h.drive():
                try:
                    info = reports[name]
                    if isinstance(info, WorkerError):
                        raise info
                    reported = parse_state(info.state)
                    if reported == WorkerState.RUNNING and h.state == WorkerState.UNCERTAIN:
                        # it answers RUNNING, but what it serves is not vouched for (drift, a partial
                        # write): it stays UNCERTAIN, whatever it reports, until re-installed here
                        problem = "recorded UNCERTAIN: what it serves is not vouched for until re-installed"
                    elif reported == WorkerState.RUNNING:
                        self.driver.observed(h, reported, rid, version=info.version, why="reports RUNNING before the rollout")
                        continue
                    else:
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
                if not self.failure.recover(h, rid, why, fb, ckpt.version):
                    unavailable.append(name)
        return unavailable

    def _reports(self, names: list[str]) -> dict[str, Any]:
        """Each worker's weight_info (or the WorkerError it gave), asked of all of them at once:
        one round trip before the first pause instead of one per worker (issue 41)."""
        def ask(name: str) -> Any:
            h = self.fleet[name]
            with h.drive():
                try:
                    return h.client.weight_info()
                except WorkerError as exc:
                    return exc

        if len(names) < 2:
            return {n: ask(n) for n in names}
        with ThreadPoolExecutor(max_workers=min(len(names), 16), thread_name_prefix="preflight") as pool:
            return dict(zip(names, pool.map(ask, names), strict=True))

    def _run_batch(
        self, batch: Batch, rid: int, target: Target, ahead: PreparedAhead | None = None
    ) -> list[tuple[WorkerHandle, bool, StepFailed | None]]:
        def one(name: str) -> tuple[WorkerHandle, bool, StepFailed | None]:
            h = self.fleet[name]
            prepared = ahead is not None and ahead.wait(name)
            with h.drive():
                try:
                    changed = self.driver.update(h, rid, target, batch.mode, prepare=not prepared, why=batch.reason)
                    return h, changed, None
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

    def _fallback_early(self, fallback: CheckpointRef | None) -> Target | None:
        try:
            return self.fallback_target(fallback)
        except Exception as exc:  # noqa: BLE001 - only a backup for _fail; it asks again itself
            log.warning("fallback_not_resolved_early", error=str(exc))
            return None

    def _fail(
        self,
        rid: int,
        ckpt: CheckpointRef,
        fallback: CheckpointRef | None,
        failures: list[tuple[WorkerHandle, StepFailed]],
        moved: list[tuple[WorkerHandle, RolloutMode]],
        batch: Batch,
        early: Target | None = None,
    ) -> Outcome:
        """`batch`: the one that failed; its mode moves its workers (a group's only worker pauses).
        `early`: the fallback as resolved when the rollout began, used when the database is out now.
        Returns the result and its `rollouts.detail`, not yet recorded."""
        first = failures[0][1]
        why = f"rollout of {ckpt.version} failed: {first}"
        try:
            fb = self.fallback_target(fallback)
        except Exception as exc:
            if not unreachable(exc):
                raise
            log.warning("fallback_from_rollout_start", version=early.version if early else None, error=str(exc))
            fb = early
        unrecovered: list[str] = []
        # 1. The failed workers: restore over the admin API, else restart. One that refused the
        #    update and kept serving is RUNNING already: it only needs to be on the fallback.
        for h, failed in failures:
            with h.drive():
                if failed.kept_serving and h.state == WorkerState.RUNNING:
                    try:
                        if fb is not None:
                            self.driver.update(h, rid, fb, batch.mode, back=True, why=batch.reason)
                    except StepFailed as exc:
                        if not self.failure.recover(h, rid, f"{why}; to the fallback: {exc}", fb, ckpt.version):
                            unrecovered.append(h.name)
                elif not self.failure.recover(h, rid, why, fb, ckpt.version):
                    unrecovered.append(h.name)
        # 2. Everyone this rollout already moved goes back too: no mixed versions.
        for h, moved_in in reversed(moved):
            with h.drive():
                try:
                    if fb is not None:
                        self.driver.update(h, rid, fb, moved_in, back=True)
                    else:
                        self.driver.revert(h, rid, moved_in)
                except StepFailed as exc:
                    log.warning("rollback_step_failed", rollout=rid, worker=h.name, reason=exc.reason)
                    if not self.failure.recover(h, rid, f"{why}; rolling back: {exc}", fb, ckpt.version):
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
        return RolloutResult(rid, RolloutOutcome.FAILED, str(first), moved=[], unrecovered=unrecovered,
                             kind=first.kind), detail  # fmt: skip


class PreparedAhead:
    """Prepare (open, read ahead and check) the workers of the later batches while the first
    batch updates, so each later worker's turn starts with its source already open: on the disk
    transport a prepare reads and hashes the whole version (~1.1 s for 8B on an H200), which was
    paid once per worker, one after the other (issue 15). A worker already on the target, or
    not RUNNING, is left to its own turn (which checks and prepares it as before)."""

    def __init__(self, driver: WorkerDriver, fleet: WorkerSet, later: list[Batch], target: Target) -> None:
        self.driver, self.fleet, self.target = driver, fleet, target
        names = [n for b in later for n in b.workers if isinstance(fleet[n].client, PreparesUpdates)]
        self._pool = ThreadPoolExecutor(max_workers=len(names), thread_name_prefix="prepare") if names else None
        self._futures: dict[str, Future[bool]] = {}
        if self._pool is not None:
            self._futures = {n: self._pool.submit(self._prepare, n) for n in names}

    def _prepare(self, name: str) -> bool:
        h = self.fleet[name]
        with h.drive():  # the health poll never sees a worker the engine is driving
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
