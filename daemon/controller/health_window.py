"""The health window after a new version reached every worker, and what its verdict means.

The workers are watched for `[rollout].health_window_s` (daemon.rollout.health) while the trial's
gates run (daemon.controller.trial, daemon.gates); a pass of both makes the version last_good. A failure rejects it (or, when a worker stopped answering, keeps it verified
and retries it, bounded: daemon.rollout.attribution) and rolls every worker back to the newest
earlier version whose files are all here; a window interrupted by a command that moves every
worker, or by shutdown, decides nothing.

    window = HealthWindow(journal, fleet, settings, engine, state,
                          interrupted=..., served=..., submit=...)
    window.watch(ckpt, rollout_id, fallback)

Run on the service's runner thread: after a new version's rollout (daemon.controller.decisions)
and at start-up when the daemon stopped inside a window (daemon.controller.startup).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from daemon.common.logging import get_logger
from daemon.config import RolloutSettings
from daemon.controller import trial
from daemon.controller.queue import RolloutState
from daemon.controller.served import ServedVersions
from daemon.gates.runner import GateRunner
from daemon.gates.settings import GateSettings
from daemon.registry.journal import CheckpointRef, Journal
from daemon.registry.status import CheckpointStatus, FailureKind, RolloutOutcome, RolloutTrigger
from daemon.rollout.attribution import attribute
from daemon.rollout.engine import RolloutEngine
from daemon.rollout.recovery import fleet_version
from daemon.rollout.states import WorkerSet

log = get_logger(__name__)
C, T = CheckpointStatus, RolloutTrigger


@dataclass
class HealthWindow:
    """Watches a freshly deployed version and acts on the verdict (see the module docstring)."""

    journal: Journal
    fleet: WorkerSet
    settings: RolloutSettings
    engine: RolloutEngine
    state: RolloutState
    _: KW_ONLY
    interrupted: Callable[[], bool]  # a command that moves every worker is waiting, or shutdown
    served: ServedVersions  # the one writer of serving and last_good
    submit: Callable[[int], None]
    gates: GateSettings = field(default_factory=GateSettings)  # the gates of its trial (daemon.controller.trial)
    gate_runner: GateRunner | None = None

    def wanted(self, ckpt: CheckpointRef) -> bool:
        """Is there a window to watch: a health window configured, or gates for this version here."""
        return self.settings.health_window_s > 0 or bool(trial.trial_of(self.journal, self.fleet, ckpt, self.gates,
                                                                          self.gate_runner)[1])  # fmt: skip

    def watch(self, ckpt: CheckpointRef, rid: int, fallback: CheckpointRef | None) -> dict[str, Any]:
        verdict = trial.watch(self.journal, self.fleet, self.settings, self.gates, self.gate_runner,
                              self.interrupted, ckpt)  # fmt: skip
        window = {"seconds": self.settings.health_window_s, "workers": verdict.workers}
        if verdict.aborted:
            self.journal.amend_rollout(rid, detail={"health_window": {**window, "aborted": True}})
            return {"health_window": "aborted"}
        if verdict.ok:
            self.journal.amend_rollout(rid, detail={"health_window": {**window, "ok": True}})
            self.served.mark_last_good(ckpt)
            return {"health_window": "ok"}
        log.warning("health_window_failed", version=ckpt.version, reason=verdict.reason, infra=verdict.infra)
        self.journal.amend_rollout(
            rid, outcome=RolloutOutcome.ROLLED_BACK,
            detail={"health_window": {**window, "ok": False, "reason": verdict.reason, "infra": verdict.infra}},
        )  # fmt: skip
        # never back onto missing files: the newest earlier version whose files are all there
        usable = self.engine.fallback_target(fallback, exclude=[ckpt.id]) if fallback is not None else None
        fallback = usable.checkpoint if usable is not None else None
        if fallback is None or fallback.id == ckpt.id:
            self.journal.note(ckpt.id, f"health window failed ({verdict.reason}) but no earlier version to roll back to")
            return {"health_window": "failed", "rolled_back": None}
        # Recorded before the rollback runs: a daemon killed during it finds the verdict written.
        retry = None
        if verdict.infra:  # a worker stopped answering: like a crash mid-rollout (daemon.rollout.attribution)
            retry = attribute(self.journal.registry, ckpt.id, FailureKind.UNREACHABLE, [], verdict.reason,
                              self.settings.max_infra_retries)  # fmt: skip
        if retry is not None and retry.verdict != "reject":
            left = self.settings.max_infra_retries - retry.attempts
            self.journal.move_status(ckpt.id, C.VERIFIED, f"rolled back to {fallback.version} after deploy: {verdict.reason}; "
                                     f"not the checkpoint's fault: rolled out again ({left} retries left)")  # fmt: skip
        else:
            self.journal.move_status(ckpt.id, C.REJECTED, f"rolled back to {fallback.version} after deploy: {verdict.reason}"
                                     + (f" ({retry.message})" if retry is not None else ""))  # fmt: skip
        self.journal.checkpoint_event(
            ckpt.id, "rolled_back", {"to": fallback.version, "by": "health_window", "reason": verdict.reason}, rid
        )
        rb = self.engine.deploy(
            fallback, trigger=T.ROLLBACK, fallback=fallback,
            detail={"by": "health_window", "from": ckpt.version, "reason": verdict.reason, "rolled_back_rollout": rid},
        )  # fmt: skip
        reported = fleet_version(self.fleet)  # serving is what the workers say they serve
        if rb.outcome == RolloutOutcome.SUCCEEDED or (
            rb.outcome == RolloutOutcome.FAILED and rb.kind != FailureKind.UNAVAILABLE and reported == fallback.version
        ):
            # A failed rollback still restored every worker it reached to the fallback.
            self.served.mark_serving(fallback, None, f"restored by automatic rollback (rollout {rb.rollout_id})")
            self.served.mark_last_good(fallback)
            if retry is not None and retry.verdict != "reject":
                self.submit(ckpt.id)
        else:
            log.error("automatic_rollback_incomplete", version=ckpt.version, outcome=rb.outcome, reason=rb.reason)
            if retry is not None and retry.verdict != "reject":
                self.state.set_blocked(ckpt)  # retried when every worker is back (see the service's poll)
        return {"health_window": "failed", "rolled_back": fallback.version, "rollback_rollout_id": rb.rollout_id,
                "rollback_outcome": rb.outcome.value, "reason": verdict.reason}  # fmt: skip
