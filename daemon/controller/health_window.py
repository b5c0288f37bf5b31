"""The health window after a version of a served name (the base model, or one LoRA adapter name)
reached every worker, and its verdict: one sequence for every name. A pass makes the version
last_good. A failure rejects it (the base model keeps it verified and retries it, bounded, when a
worker stopped answering: daemon.rollout.attribution) and rolls every worker back to the name's
fallback (the base's newest earlier version whose files are all here; an adapter's previous one,
or none: unloaded). A window cut short by a command that moves every worker, or by shutdown,
decides nothing. How a name is watched, made last_good, rejected and rolled back is its
`Watched`: the base model's here (health and gates: daemon.controller.trial), an adapter's in
daemon.controller.adapters.

    window = BaseWindow(journal, fleet, settings, engine, state, interrupted=..., served=..., submit=...).open(ckpt, rid, fallback)
    HealthWindow(journal, settings, interrupted).settle(window)   # one step; None while it is open
    HealthWindow(journal, settings, interrupted).watch(watched, rid)   # opened and stepped to its verdict here

Stepped by the service's runner between its passes (daemon.controller.service), start-up's too
(queued as the first job); an adapter reconcile's windows are stepped to the verdict in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, NamedTuple, Protocol

from daemon.common import get_logger
from daemon.config import RolloutSettings
from daemon.controller import trial
from daemon.controller.queue import RolloutState
from daemon.controller.served import ServedVersions
from daemon.gates import GateRunner, GateSettings
from daemon.registry import (
    CheckpointRef,
    CheckpointStatus,
    FailureKind,
    Journal,
    RolloutOutcome,
    RolloutTrigger,
)
from daemon.rollout import (
    RolloutEngine,
    Stepped,
    WindowVerdict,
    WorkerSet,
    attribute,
    fleet_version,
    step_until_done,
)

log = get_logger(__name__)
C, T = CheckpointStatus, RolloutTrigger


class Fallback(NamedTuple):
    version: str | None  # None: the name unloaded (an adapter with no earlier version)


class Watched(Protocol):
    """One served name's part in a window over one of its versions."""

    @property
    def checkpoint(self) -> CheckpointRef: ...  # the version watched
    @property
    def about(self) -> dict[str, str]: ...  # who it is, in the log
    def start(self, interrupted: Callable[[], bool]) -> Stepped: ...  # the window opened, stepped to its verdict
    def passed(self) -> None: ...  # the version is last_good
    def fallback(self) -> Fallback | None: ...  # where a failed version goes back to; None: nowhere
    def reject(self, verdict: WindowVerdict, why: str) -> None: ...  # the version's status after a failed window
    def roll_back(self, verdict: WindowVerdict, rid: int) -> dict[str, Any]: ...  # every worker onto the fallback


def reject_or_retry(journal: Journal, settings: RolloutSettings, checkpoint_id: int, verdict: WindowVerdict,
                    why: str) -> bool:  # fmt: skip
    """A failed window's mark on the version, for every served name: rejected, unless a worker
    stopped answering (like a crash mid-rollout: daemon.rollout.attribution). Then it stays verified,
    to be rolled out again after the rollback, until `max_infra_retries` such windows. True: retry it."""
    retry = None
    if verdict.infra:
        retry = attribute(journal.registry, checkpoint_id, FailureKind.UNREACHABLE, [], verdict.reason,
                          settings.max_infra_retries)  # fmt: skip
    if retry is not None and retry.verdict != "reject":
        left = settings.max_infra_retries - retry.attempts
        journal.move_status(checkpoint_id, C.VERIFIED, f"{why}; not the checkpoint's fault: rolled out again ({left} retries left)")
        return True
    journal.move_status(checkpoint_id, C.REJECTED, why + (f" ({retry.message})" if retry is not None else ""))
    return False


@dataclass
class OpenWindow:
    """A window opened over one served name's version: a condition its owner steps (`settle`) on
    each pass until the verdict, not a wait; `due` is when a step has something to do (monotonic)."""

    name: Watched
    rid: int
    stepped: Stepped
    interrupted: Callable[[], bool]  # a command that ends it is waiting, or shutdown
    seconds: float = 0.0  # [rollout] health_window_s (its gates may take longer)
    opened: float = field(default_factory=time.time)

    @property
    def due(self) -> float:
        return self.stepped.due

    def describe(self) -> dict[str, Any]:
        """What status says of it: whose window, since when, and about how long is left."""
        left = max(0.0, self.opened + self.seconds - time.time())
        return {**self.name.about, "rollout_id": self.rid, "seconds": self.seconds, "left_s": round(left, 1)}


class Windowed(Protocol):
    """A decider whose job may leave a health window open for the runner to step (the base's
    daemon.controller.decisions, the adapters' daemon.controller.adapters)."""

    window: OpenWindow | None

    def settle(self) -> dict[str, Any] | None: ...


@dataclass
class HealthWindow:
    """The one window sequence, for every served name (see the module docstring)."""

    journal: Journal
    settings: RolloutSettings
    interrupted: Callable[[], bool]  # a command that moves every worker is waiting, or shutdown

    def open(self, name: Watched, rid: int) -> OpenWindow:
        return OpenWindow(name, rid, name.start(self.interrupted), self.interrupted, self.settings.health_window_s)

    def settle(self, window: OpenWindow) -> dict[str, Any] | None:
        """One step of `window`; None while it is open, else what its verdict did. Called again
        after a failure (the database out, say), it applies the same verdict again."""
        verdict = window.stepped.step()
        return None if verdict is None else self._decided(window.name, window.rid, verdict)

    def watch(self, name: Watched, rid: int) -> dict[str, Any]:
        """Open a window and step it to its verdict here (an adapter reconcile, or a deploy it makes)."""
        window = self.open(name, rid)
        return step_until_done(lambda: self.settle(window), lambda: window.due)

    def _decided(self, name: Watched, rid: int, verdict: WindowVerdict) -> dict[str, Any]:
        ckpt = name.checkpoint
        window = {"seconds": self.settings.health_window_s, "workers": verdict.workers}
        if verdict.aborted:
            self.journal.amend_rollout(rid, detail={"health_window": {**window, "aborted": True}})
            return {"health_window": "aborted"}
        if verdict.ok:
            self.journal.amend_rollout(rid, detail={"health_window": {**window, "ok": True}})
            name.passed()
            return {"health_window": "ok"}
        log.warning("health_window_failed", **name.about, reason=verdict.reason, infra=verdict.infra)
        self.journal.amend_rollout(
            rid, outcome=RolloutOutcome.ROLLED_BACK,
            detail={"health_window": {**window, "ok": False, "reason": verdict.reason, "infra": verdict.infra}},
        )  # fmt: skip
        back = name.fallback()
        if back is None:
            self.journal.note(ckpt.id, f"health window failed ({verdict.reason}) but no earlier version to roll back to")
            return {"health_window": "failed", "rolled_back": None}
        # Recorded before the rollback runs: a daemon killed during it finds the verdict written.
        name.reject(verdict, f"rolled back to {back.version or 'none'} after deploy: {verdict.reason}")
        self.journal.checkpoint_event(ckpt.id, "rolled_back", {"to": back.version, "by": "health_window",
                                                               "reason": verdict.reason}, rid)  # fmt: skip
        return {"health_window": "failed", "rolled_back": back.version, **name.roll_back(verdict, rid), "reason": verdict.reason}


@dataclass
class BaseWindow:
    """The base model's window: its trial (health and gates), last_good through ServedVersions, and
    a rollback through the engine onto the newest earlier version whose files are all here."""

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

    @property
    def sequence(self) -> HealthWindow:
        return HealthWindow(self.journal, self.settings, self.interrupted)

    def open(self, ckpt: CheckpointRef, rid: int, fallback: CheckpointRef | None) -> OpenWindow:
        return self.sequence.open(_BaseVersion(self, ckpt, fallback), rid)


@dataclass
class _BaseVersion:
    """The base model's part in a window over `checkpoint` (a Watched)."""

    of: BaseWindow
    checkpoint: CheckpointRef
    to: CheckpointRef | None  # the fallback
    retried: bool = False  # a worker stopped answering, not the version's fault: rolled out again

    @property
    def about(self) -> dict[str, str]:
        return {"version": self.checkpoint.version}

    def start(self, interrupted: Callable[[], bool]) -> Stepped:
        o = self.of
        return trial.TrialWatch(o.journal, o.fleet, o.settings, o.gates, o.gate_runner, interrupted, self.checkpoint)

    def passed(self) -> None:
        self.of.served.mark_last_good(self.checkpoint)

    def fallback(self) -> Fallback | None:
        usable = self.of.engine.fallback_target(self.to, exclude=[self.checkpoint.id])  # never onto missing files
        self.to = usable.checkpoint if usable is not None else None
        return Fallback(self.to.version) if self.to is not None and self.to.id != self.checkpoint.id else None

    def reject(self, verdict: WindowVerdict, why: str) -> None:
        self.retried = reject_or_retry(self.of.journal, self.of.settings, self.checkpoint.id, verdict, why)

    def roll_back(self, verdict: WindowVerdict, rid: int) -> dict[str, Any]:
        o, ckpt, to = self.of, self.checkpoint, self.to
        assert to is not None  # fallback() found one
        rb = o.engine.deploy(to, trigger=T.ROLLBACK, fallback=to, detail={
            "by": "health_window", "from": ckpt.version, "reason": verdict.reason, "rolled_back_rollout": rid})  # fmt: skip
        reported = fleet_version(o.fleet)  # serving is what the workers say they serve
        if rb.outcome == RolloutOutcome.SUCCEEDED or (
            rb.outcome == RolloutOutcome.FAILED and rb.kind != FailureKind.UNAVAILABLE and reported == to.version
        ):
            # A failed rollback still restored every worker it reached to the fallback.
            o.served.mark_serving(to, None, f"restored by automatic rollback (rollout {rb.rollout_id})")
            o.served.mark_last_good(to)
            if self.retried:
                o.submit(ckpt.id)
        else:
            log.error("automatic_rollback_incomplete", version=ckpt.version, outcome=rb.outcome, reason=rb.reason)
            if self.retried:
                o.state.set_blocked(ckpt)  # retried when every worker is back (see the service's poll)
        return {"rollback_rollout_id": rb.rollout_id, "rollback_outcome": rb.outcome.value}
