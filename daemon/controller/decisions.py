"""The runner's jobs and what their results mean for the registry.

A new checkpoint deployed, superseded, skipped or put back to wait for newer ones still being
verified, as its desired state says (daemon.controller.desired); an operator's rollback, pin and
unpin, the fleet target converged to, a reconcile of drifted workers (and of a managed worker's
fallback); then `conclude`: which version is serving, last_good, rejected, retried or held back
for unavailable workers.

    decisions = RolloutDecisions(journal, fleet, settings, engine, driver, state, queue, stopping,
                                 served=served, submit=service.submit, gates=gates)
    decisions.deploy_new(ckpt)

Called only on the service's runner thread (daemon.controller.service), which owns the queue and
the state; a new version's health window is daemon.controller.health_window; serving and
last_good are written through daemon.controller.served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from daemon.common import get_logger
from daemon.config import RolloutSettings
from daemon.controller.commands import OPEN, Command, Pin, Reconcile, Rollback
from daemon.controller.desired import Facts, desired, lookahead
from daemon.controller.health_window import BaseWindow, OpenWindow
from daemon.controller.queue import CommandError, RolloutQueue, RolloutState
from daemon.controller.served import ServedVersions
from daemon.engines import WorkerError
from daemon.gates import GateRunner, GateSettings
from daemon.registry import (
    DEPLOYABLE,
    WAITING,
    CheckpointRef,
    CheckpointStatus,
    FailureKind,
    Journal,
    RolloutOutcome,
    RolloutTrigger,
    unreachable,
)
from daemon.rollout import (
    RolloutEngine,
    RolloutResult,
    WorkerDriver,
    WorkerSet,
    WorkerState,
    attribute,
    newer,
    recover_uncertain,
)

log = get_logger(__name__)
C, T = CheckpointStatus, RolloutTrigger
R = TypeVar("R")

RECHECK_S = 0.5  # a checkpoint waiting for newer ones is looked at again this often (one query each)
MOVES_FLEET: tuple[type[Command], ...] = (Rollback, Pin)  # operator commands that redeploy every worker


class RolloutDecisions:
    """Each job of the runner, run to the end, and the registry rows its result leaves."""

    def __init__(
        self,
        journal: Journal,
        fleet: WorkerSet,
        settings: RolloutSettings,
        engine: RolloutEngine,
        driver: WorkerDriver,
        state: RolloutState,
        queue: RolloutQueue,
        stopping: threading.Event,
        *,
        served: ServedVersions,
        submit: Callable[[int], None],
        gates: GateSettings | None = None,
    ) -> None:
        """`gates`: the trial's gates (daemon.controller.trial), run beside the health window."""
        self.journal = journal
        self.fleet = fleet
        self.settings = settings
        self.engine = engine
        self.driver = driver
        self.state = state
        self.queue = queue
        self.stopping = stopping
        self.served = served  # the one writer of serving and last_good
        self.submit = submit  # the service's: a version to roll out (again)
        self.health_window = BaseWindow(
            journal, fleet, settings, engine, state,
            interrupted=lambda: queue.has_command(MOVES_FLEET) or stopping.is_set(),
            served=served, submit=submit,
        )  # fmt: skip
        if gates is not None and gates.gate:
            self.health_window.gates, self.health_window.gate_runner = gates, GateRunner(journal.registry, gates)
        # fleet mode: a converge to a staged rollout's version gets a health window (daemon.fleet.stages)
        self.watch_fleet: Callable[[CheckpointRef], bool] = lambda _ckpt: False
        self.window: OpenWindow | None = None  # a new version's health window, open: the runner steps it (settle)
        self._fallback_to: str | None = None  # a managed worker fell back to it; made serving by reconcile
        self._waiting: tuple[int, float] | None = None  # (checkpoint id, since): it waits for newer ones

    def _yield_wanted(self, ckpt: CheckpointRef) -> bool:
        """Stop a rollout at the next batch boundary: something that moves every worker anyway is waiting."""
        return self.queue.newer_than(ckpt) or self.queue.has_command(MOVES_FLEET) or self.stopping.is_set()

    # -- jobs ------------------------------------------------------------------------------
    def deploy_new(self, ckpt: CheckpointRef) -> dict[str, Any]:
        """One pass over the waiting checkpoint: its desired step (daemon.controller.desired) done.
        A wait never blocks the runner: the checkpoint goes back to the queue's waiting slot and
        is looked at again on a later pass, so operator commands queued meanwhile run first."""
        now = time.monotonic()
        since = self._waiting[1] if self._waiting is not None and self._waiting[0] == ckpt.id else now
        facts = Facts(candidate=ckpt, now=now, waiting_since=since, stopping=self.stopping.is_set(),
                      newer_queued=self.queue.pending if self.queue.newer_than(ckpt) else None,
                      newer_verifying=self.journal.newer_in_verification(ckpt.id))  # fmt: skip
        if (wait := lookahead(facts)) is not None:  # the one query of a pass that waits
            self._waiting = (ckpt.id, since)
            replaced = self.queue.put_back(ckpt, until=min(now + RECHECK_S, wait.until or now))
            if replaced is not None and replaced.id == ckpt.id:  # a newer one arrived meanwhile
                self.supersede(ckpt, by=self.queue.pending)
                return {"version": ckpt.version, "outcome": "superseded"}
            if replaced is not None:  # an older one had taken the slot meanwhile
                self.supersede(replaced, by=ckpt)
            return {"version": ckpt.version, "outcome": "waiting", "reason": wait.reason}
        self._waiting = None
        facts = replace(facts, fresh=self.journal.checkpoint(ckpt.id), serving=self.journal.alias("serving"))
        step = desired(facts)
        fresh, serving = step.checkpoint, facts.serving
        if step.action == "supersede":
            self.supersede(fresh, by=step.by)
            out = {"version": fresh.version, "outcome": "superseded"}
            return {**out, "by": serving.version} if serving is not None and step.by is serving else out
        if step.action == "skip":
            return {"version": ckpt.version, "outcome": "skipped", "status": facts.fresh.status if facts.fresh else None}
        fallback = self.fallback()
        result = self.engine.deploy(
            fresh, trigger=T.NEW, fallback=fallback, should_yield=lambda: self._yield_wanted(fresh)
        )
        return self.recorded(lambda: self.conclude(fresh, result, serving, fallback, trigger=T.NEW))

    def _deployable(self, version: str) -> CheckpointRef:
        ckpt = self.journal.checkpoint_by_version(version)
        if ckpt is None:
            raise CommandError(f"unknown version {version!r} (see `hotswap history`)", 404)
        if not ckpt.verified or ckpt.status not in DEPLOYABLE:
            raise CommandError(f"version {version!r} is {ckpt.status}: only verified versions can be deployed")
        if not ckpt.local_path or not Path(ckpt.local_path).is_dir():
            raise CommandError(f"version {version!r} has no local copy (was {ckpt.local_path!r})")
        return ckpt

    def rollback(self, to: str | None, by: str = "operator") -> dict[str, Any]:
        serving = self.journal.alias("serving")
        if to is not None:
            target = self._deployable(to)
        else:
            last_good = self.journal.alias("last_good")
            if last_good is not None and serving is not None and last_good.id != serving.id:
                candidate: CheckpointRef | None = last_good
            else:
                candidate = self.journal.previous_deployed(serving.id if serving else -1)
            if candidate is None:
                raise CommandError("nothing to roll back to: no earlier version was ever deployed")
            target = self._deployable(candidate.version)
        pinned = self.state.pinned
        if pinned is not None and pinned != target.version:
            raise CommandError(f"pinned to {pinned}: run `hotswap unpin` first")
        # If the target cannot be installed (its files changed since verify), the workers go back
        # to what they serve now, never to the target again.
        fallback = serving if serving is not None and serving.id != target.id else target
        result = self.engine.deploy(
            target, trigger=T.ROLLBACK, fallback=fallback,
            detail={"by": by, "from": serving.version if serving else None},
        )  # fmt: skip
        if result.outcome == RolloutOutcome.SUCCEEDED:
            self.recorded(lambda: self._rolled_back(target, serving, result.rollout_id, by))
        return {"rollout_id": result.rollout_id, "version": target.version, "outcome": result.outcome.value,
                "reason": result.reason, "from": serving.version if serving else None}  # fmt: skip

    def _rolled_back(self, target: CheckpointRef, serving: CheckpointRef | None, rid: int, by: str) -> None:
        replaced = serving if serving is not None and serving.id != target.id else None
        if replaced is not None:
            old = self.journal.checkpoint(replaced.id)
            if old is not None and old.status != C.RETIRED:
                self.journal.checkpoint_event(replaced.id, "rolled_back", {"to": target.version, "by": by}, rid)
        # the target deployed and the version it replaced retired in one transaction: a reader
        # never finds no version deployed between them
        self.served.mark_serving(target, replaced, f"restored by {by}'s rollback (rollout {rid})",
                                 retired_why=f"rolled back by {by} to {target.version}")  # fmt: skip
        self.served.mark_last_good(target)

    def pin(self, version: str, force: bool = False, by: str = "operator") -> dict[str, Any]:
        ref = self.journal.checkpoint_by_version(version)
        if ref is not None and ref.status == C.REJECTED and not ref.verified:
            raise CommandError(f"version {version!r} was rejected by its checks (see `hotswap show {version}`): "
                               "it was never verified, so it cannot be pinned, even with --force")  # fmt: skip
        target = self._deployable(version)
        if target.status == C.REJECTED and not force:
            raise CommandError(f"version {version!r} was rejected (see `hotswap history`): "
                               "pin it anyway with --force")  # fmt: skip
        serving = self.journal.alias("serving")
        self.journal.set_alias("pinned", target.id)
        self.journal.checkpoint_event(target.id, "pinned", {"by": by, "force": force}, None)
        self.state.set_pinned(target.version)
        out: dict[str, Any] = {"pinned": target.version, "outcome": "pinned", "rollout_id": None}
        fallback = self.fallback()
        result = self.engine.deploy(
            target, trigger=T.MANUAL, fallback=fallback if fallback and fallback.id != target.id else serving,
            detail={"by": by, "pin": True},
        )  # fmt: skip
        out.update(rollout_id=result.rollout_id, outcome=result.outcome.value, reason=result.reason)
        if result.outcome == RolloutOutcome.SUCCEEDED:
            def pinned() -> None:
                self.served.mark_serving(target, serving, f"pinned by {by} (rollout {result.rollout_id})")
                self.served.mark_last_good(target)

            self.recorded(pinned)
        else:
            self.journal.set_alias("pinned", None)
            self.state.set_pinned(None)
            out["pinned"] = None
        return out

    def converge(self, version: str) -> dict[str, Any]:
        target = self._deployable(version)
        if target.status == C.REJECTED:
            # rejected since the fleet agent asked (its window here failed, a stage halted): only an
            # operator's `pin --force` deploys a rejected version, never the fleet's converge
            raise CommandError(f"version {version!r} was rejected (see `hotswap show {version}`): a fleet converge "
                               "does not deploy it")  # fmt: skip
        serving = self.journal.alias("serving")
        if self.state.pinned is not None or (serving is not None and serving.id == target.id):
            return {"version": version, "outcome": "skipped", "pinned": self.state.pinned}
        fallback = self.fallback()
        result = self.engine.deploy(target, trigger=T.FLEET, fallback=fallback, detail={"by": "fleet"},
                                    should_yield=lambda: self.queue.has_command(MOVES_FLEET) or self.stopping.is_set())  # fmt: skip
        return self.recorded(lambda: self.conclude(target, result, serving, fallback, trigger=T.FLEET))

    def unpin(self, by: str = "operator") -> dict[str, Any]:
        was = self.state.pinned
        if was is not None and (ref := self.journal.checkpoint_by_version(was)) is not None:
            self.journal.checkpoint_event(ref.id, "unpinned", {"by": by}, None)
        self.journal.set_alias("pinned", None)
        self.state.set_pinned(None)
        pending = self.queue.pending
        self.queue.wake()
        return {"unpinned": was, "outcome": "unpinned", "next": pending.version if pending else None}

    def fell_back(self, version: str) -> None:
        """The supervisor's `on_fallback`: a managed worker serves `version` because serving's
        files cannot be launched here; the runner makes it serving (and brings the rest to it)."""
        self._fallback_to = version
        self.queue.command(Reconcile())

    def _take_fallback(self, serving: CheckpointRef | None) -> CheckpointRef | None:
        version, self._fallback_to = self._fallback_to, None
        ckpt = self.journal.checkpoint_by_version(version) if version else None
        if ckpt is None or serving is None or ckpt.id == serving.id:
            return serving
        why = f"{serving.version} cannot be launched on this host; a managed worker fell back to {ckpt.version}"
        self.journal.checkpoint_event(ckpt.id, "fallback", {"from": serving.version, "by": "supervisor"}, None)
        last_good = self.journal.alias("last_good")
        if last_good is None or last_good.id == serving.id:
            # before serving moves: whoever sees the new serving version sees its last_good too
            self.served.mark_last_good(ckpt)
        self.served.mark_serving(ckpt, serving, why)
        log.warning("serving_fell_back", version=ckpt.version, was=serving.version)
        return ckpt

    def reconcile(self) -> dict[str, Any]:
        """Bring workers that run something other than the serving version back to it."""
        serving = self._take_fallback(self.journal.alias("serving"))
        if serving is None:
            return {"outcome": "nothing to reconcile"}
        target = self.engine.fallback_target(serving)
        restored = recover_uncertain(self.driver, self.fleet, target)
        drifted = []
        for h in self.fleet:
            try:
                info = h.client.weight_info()
            except WorkerError:
                continue
            if info.state == WorkerState.RUNNING and target is not None and not target.matches(info):
                drifted.append(h.name)
        if not drifted:
            return {"outcome": "in sync", "restored": restored}
        log.warning("reconciling", workers=drifted, version=serving.version)
        result = self.engine.deploy(
            serving, trigger=T.ROLLBACK, fallback=serving, only=drifted, detail={"by": "reconcile"}
        )
        return {"rollout_id": result.rollout_id, "outcome": result.outcome.value, "workers": drifted}

    def gate_problems(self) -> list[tuple[str, str]]:
        """Gates of a trial that cannot run now, with why (the problem gate_cannot_run)."""
        runner = self.health_window.gate_runner
        return runner.problems() if runner is not None else []

    # -- what a rollout's result means for the registry ------------------------------------
    def recorded(self, step: Callable[[], R]) -> R:
        """Run a step that records a finished rollout's result. While the database is out (the
        engine kept the workers' transitions for later: daemon.registry.outbox) wait for it,
        then run the step again: each of its writes looks at what is recorded first, so a second
        run completes the first. The workers serve meanwhile; /health says what is wrong."""
        while True:
            try:
                return step()
            except Exception as exc:
                if not unreachable(exc) or self.stopping.is_set():
                    raise
                log.warning("rollout_result_waits_for_database", error=" ".join(str(exc).split())[:300],
                            serving=self.state.serving)  # fmt: skip
                self.journal.registry.wait_until_writable(self.stopping)

    def conclude(
        self,
        ckpt: CheckpointRef,
        result: RolloutResult,
        previous: CheckpointRef | None,
        fallback: CheckpointRef | None,
        *,
        trigger: RolloutTrigger,
    ) -> dict[str, Any]:
        out = {"rollout_id": result.rollout_id, "version": ckpt.version, "outcome": result.outcome.value,
               "reason": result.reason}  # fmt: skip
        if result.outcome == RolloutOutcome.SUCCEEDED:
            self.served.mark_serving(ckpt, previous, f"serving on every worker (rollout {result.rollout_id})")
            if (trigger == T.NEW or (trigger == T.FLEET and self.watch_fleet(ckpt))) and self.health_window.wanted(ckpt):
                # a condition the runner evaluates on its passes (settle), not a wait here
                self.window = self.health_window.open(ckpt, result.rollout_id, fallback)
                out["health_window"] = OPEN
            else:
                self.served.mark_last_good(ckpt)
        elif result.outcome == RolloutOutcome.FAILED and trigger == T.NEW:
            verdict = attribute(self.journal.registry, ckpt.id, result.kind, result.unrecovered, result.reason,
                                self.settings.max_infra_retries)  # fmt: skip
            out["attribution"] = verdict.verdict
            where = fallback.version if fallback else "their previous version"
            if verdict.verdict == "reject":
                self.journal.move_status(
                    ckpt.id, C.REJECTED, f"rollout {result.rollout_id} failed: {result.reason}; workers restored to {where}"
                    + (f" ({verdict.message})" if verdict.attempts else ""),
                )  # fmt: skip
            else:
                # Not the version's fault: it stays verified and is rolled out again (bounded).
                self.journal.note(ckpt.id, f"rollout {result.rollout_id}: {verdict.message}")
                log.warning("rollout_failed_not_the_checkpoint", version=ckpt.version, kind=result.kind,
                            attempts=verdict.attempts, retry=verdict.verdict)  # fmt: skip
                if verdict.verdict == "retry_when_back":
                    self.state.set_blocked(ckpt)  # see the service's poll
                else:
                    self.submit(ckpt.id)
        elif result.outcome == RolloutOutcome.FAILED and result.kind == FailureKind.UNAVAILABLE:
            self.state.set_blocked(ckpt)  # an operator's target: retried when every worker is back
            self.journal.note(ckpt.id, f"not deployed yet (rollout {result.rollout_id}): {result.reason}")
        elif result.outcome == RolloutOutcome.SUPERSEDED:
            pending = self.queue.pending
            if pending is not None and newer(pending, ckpt):
                self.supersede(ckpt, by=pending, rollout_id=result.rollout_id)
            else:
                why = "the daemon shutting down (resumed on its next start)" if self.stopping.is_set() else "an operator command"
                self.journal.note(ckpt.id, f"rollout {result.rollout_id} stopped for {why}")
        return out

    def resume_window(self, ckpt: CheckpointRef, rollout_id: int, fallback: CheckpointRef | None) -> dict[str, Any]:
        """The health window of a serving version never trusted (the daemon stopped inside it),
        open again for the runner to step; one start-up's recovery opened already is taken as is."""
        if self.window is None or self.window.rid != rollout_id:
            self.window = self.health_window.open(ckpt, rollout_id, fallback)
        return {"version": ckpt.version, "rollout_id": rollout_id, "health_window": OPEN}

    def settle(self) -> dict[str, Any] | None:
        """One step of the open health window (when due); None while it stays open, else what its
        verdict did (last_good, or rejected or retried and rolled back), and the window is closed."""
        window = self.window
        assert window is not None
        out = self.recorded(lambda: self.health_window.sequence.settle(window))
        if out is not None:
            self.window = None
        return out

    def supersede(self, ckpt: CheckpointRef, by: CheckpointRef | None, rollout_id: int | None = None) -> None:
        fresh = self.journal.checkpoint(ckpt.id)
        if fresh is None or fresh.status not in WAITING:
            return
        where = f" during rollout {rollout_id}" if rollout_id else " before it was deployed"
        self.journal.move_status(
            ckpt.id, C.SUPERSEDED, f"superseded by {by.version if by else 'a newer version'}{where}",
            detail={"by": by.version if by else None, "rollout_id": rollout_id},
        )  # fmt: skip
        log.info("superseded", version=ckpt.version, by=by.version if by else None)

    def fallback(self) -> CheckpointRef | None:
        """The version a failed rollout returns to: last_good, else serving, else what workers run now."""
        fb = self.journal.alias("last_good") or self.journal.alias("serving")
        if fb is not None:
            return fb
        for h in self.fleet:
            try:
                info = h.client.weight_info()
            except WorkerError:
                continue
            known = self.journal.checkpoint_by_version(info.version) if info.version else None
            if known is not None and known.local_path:
                return known
        return None
