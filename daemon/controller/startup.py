"""Start-up, before the runner takes its first job: the seed, managed workers, crash recovery.

`seed_if_empty` (on the caller's thread, in `RolloutService.start`): a fleet of managed workers
only, with nothing deployed yet, serves the tiny seed. `run` (first on the runner's thread):
managed workers adopted or launched, unfinished rollouts finished or undone (a fleet rollout that
had not moved a worker yet is closed: the fleet agent decides again), an interrupted health window
(or the window of a rollout finished here) queued as the first job, a reconcile queued and a
waiting version resumed.

    startup = Startup(journal, fleet, settings, state_dir, state, queue, supervisor, leases,
                      stopping, engine, driver, decisions, submit=service.submit)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from daemon.common import get_logger
from daemon.config import RolloutSettings
from daemon.controller.commands import AdapterReconcile, Reconcile, ResumeWindow
from daemon.controller.decisions import RolloutDecisions
from daemon.controller.queue import RolloutQueue, RolloutState
from daemon.controller.supervise import Supervisor
from daemon.engines import WorkerError
from daemon.fleet import FleetLeases, holding
from daemon.registry import (
    CheckpointRef,
    CheckpointStatus,
    Journal,
    RolloutOutcome,
    RolloutRef,
    RolloutTrigger,
)
from daemon.rollout import (
    Recovery,
    RolloutEngine,
    RolloutResult,
    WorkerDriver,
    WorkerSet,
    WorkerState,
    ensure_seed,
    newer,
    newest,
    parse_state,
)

log = get_logger(__name__)
C, T = CheckpointStatus, RolloutTrigger
NEVER_MOVED = "the daemon stopped before any worker moved; the fleet agent decides again"


@dataclass
class Startup:
    """What the service does once, at start, before any queued checkpoint."""

    journal: Journal
    fleet: WorkerSet
    settings: RolloutSettings
    state_dir: Path
    state: RolloutState
    queue: RolloutQueue
    supervisor: Supervisor
    leases: FleetLeases | None
    stopping: threading.Event
    engine: RolloutEngine
    driver: WorkerDriver
    decisions: RolloutDecisions
    _: KW_ONLY
    submit: Callable[[int], None]
    observe: Callable[[], None]  # one health-poll pass: each worker's row from its own answer

    def run(self) -> None:
        """First on the runner's thread, before any queued checkpoint: unfinished rollouts are
        finished or undone, an interrupted health window is watched again (the first job),
        drifted workers are reconciled and a waiting version is resumed."""
        pinned = self.journal.alias("pinned")
        self.state.set_pinned(pinned.version if pinned else None)
        serving = self._launch_managed()
        self.state.set_serving(serving.version if serving else None)
        open_rollouts = self.journal.unfinished_rollouts()
        for r in open_rollouts[:-1]:
            self.journal.finish_rollout(r.id, RolloutOutcome.FAILED, {"reason": "left unfinished; a later rollout replaced it"})
        last = open_rollouts[-1] if open_rollouts else None
        if last is not None and last.trigger == T.FLEET and self._never_moved(last):
            # it was waiting for a lease slot: the fleet agent decides again (its stage may have
            # halted meanwhile) rather than this start finishing it
            self.journal.finish_rollout(last.id, RolloutOutcome.SUPERSEDED, {"reason": NEVER_MOVED})
            log.info("rollout_closed_unmoved", rollout=last.id, version=last.checkpoint.version)
            last = None
        if last is not None:
            with holding(self.leases, last.checkpoint, self.stopping.is_set):
                self._recover_unfinished(last)
        else:
            # Nothing to recover: record where each worker is now, from its own answer, before
            # the first job (the registry would otherwise say UNKNOWN until the first poll).
            self.observe()
            serving = self.journal.alias("serving")
            last_good = self.journal.alias("last_good")
            rid = self.journal.last_rollout_of(serving.id) if serving else None
            if serving is not None and rid is not None and (last_good is None or last_good.id != serving.id):
                # The daemon stopped inside a health window: watched again before trusting the
                # version, as the first job (an operator's rollback or pin may cut it short)
                log.info("health_window_resumed", version=serving.version)
                self.queue.command(ResumeWindow(serving, rid, last_good))
        self.queue.command(Reconcile())
        self.queue.command(AdapterReconcile())  # every worker onto each adapter's serving version
        serving = self.journal.alias("serving")
        waiting = newest([c for c in self.journal.waiting() if serving is None or newer(c, serving)])
        if waiting is not None:
            log.info("resuming_waiting_checkpoint", version=waiting.version)
            self.submit(waiting.id)

    def _never_moved(self, rollout: RolloutRef) -> bool:
        """No worker event of `rollout` and every worker answers RUNNING: it stopped before its
        first worker left RUNNING (a fleet rollout waits for its lease slot there)."""
        if any(worker is not None for worker, _, _ in self.journal.rollout_events(rollout.id)):
            return False
        try:
            return all(parse_state(h.client.weight_info().state) == WorkerState.RUNNING for h in self.fleet)
        except WorkerError:
            return False

    def seed_if_empty(self) -> None:
        """A fleet of managed workers only, with nothing deployed yet: serve the tiny seed."""
        managed = [h for h in self.fleet if h.managed is not None]
        if not managed or len(managed) != len(self.fleet) or any(h.spec.model for h in managed):
            return
        if self.journal.alias("serving") is None:
            self.decisions.served.seed(ensure_seed(self.journal, self.state_dir))

    def _launch_managed(self) -> CheckpointRef | None:
        managed = [h for h in self.fleet if h.managed is not None]
        for h in managed:
            assert h.managed is not None
            if not h.managed.adopt():
                self.supervisor.launch(h)  # on serving, else the newest good version present here
        for h in managed:  # healthy, or failed (recorded with its log's last lines, relaunched with backoff)
            if not self.supervisor.wait_settled(h, self.settings.restart_timeout_s + 5):
                log.error("managed_worker_not_ready", worker=h.name,
                          log_file=str(h.managed.log_file if h.managed else ""))  # fmt: skip
        return self.journal.alias("serving")

    def _recover_unfinished(self, rollout: RolloutRef) -> None:
        fb_version = rollout.detail.get("fallback")
        fallback = self.journal.checkpoint_by_version(fb_version) if fb_version else None
        serving = self.journal.alias("serving")
        rec = Recovery(self.journal, self.engine, self.driver).run(rollout, fallback)
        detail = {"recovered": True, "recovered_to": rec.version, "unrecovered": rec.unrecovered}
        ckpt = rollout.checkpoint
        if rec.finished and not rec.unrecovered:
            self.journal.finish_rollout(rollout.id, RolloutOutcome.SUCCEEDED, detail)
            self.decisions.conclude(ckpt, RolloutResult(rollout.id, RolloutOutcome.SUCCEEDED), serving, fallback,
                                    trigger=rollout.trigger)  # fmt: skip
            if self.decisions.window is not None:
                # the window conclude opened is the first job's (it holds the runner): the daemon is
                # ready meanwhile, and an operator's rollback or pin ends it
                self.queue.command(ResumeWindow(ckpt, rollout.id, fallback))
        else:
            reason = "daemon restarted after the rollout had failed; undone" if not rec.finished else "not every worker recovered"
            self.journal.finish_rollout(rollout.id, RolloutOutcome.FAILED, {**detail, "reason": reason})
            if rollout.trigger == T.NEW:
                self.journal.move_status(ckpt.id, C.REJECTED, f"rollout {rollout.id}: {reason}")
