"""One worker through the state machine: the normal path, and the record of a failed step.

Every transition is committed to `events` (with the step's duration) before the next step
starts; `move` is the only way a worker's state changes. A step that fails moves the worker to
UNHEALTHY (or UNCERTAIN, when the step may have changed weights on an engine without atomic
updates) and raises `StepFailed`; the way back (restore, restart) is daemon.rollout.failure. An
update the worker refuses before writing anything is not a failure of the worker: it resumes on
what it served and goes straight back to RUNNING (`refused`), and the rollout fails.

What a worker can do comes from its client's `capabilities` (pause modes, drain, whether it
restores by itself, whether its updates are atomic); the driver never asks its kind.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from daemon.common import get_logger
from daemon.config import RolloutMode, RolloutSettings
from daemon.engines import (
    NonFiniteOutput,
    PreparesUpdates,
    ResumesAfterUpdate,
    UpdateRefused,
    UpdateResult,
    WeightInfo,
    WorkerError,
    WorkerUnreachable,
)
from daemon.registry import FailureKind, Journal
from daemon.rollout.managed import Restarter
from daemon.rollout.relaunch import Relauncher
from daemon.rollout.stage import Target
from daemon.rollout.states import (
    ALLOWED,
    BEGIN_STATE,
    Transition,
    TransitionObserver,
    WorkerHandle,
    WorkerState,
    check_transition,
    parse_state,
)

log = get_logger(__name__)
S = WorkerState

# Steps after which a non-atomic engine may hold a mix of two versions.
WRITE_STEPS = ("update", "rollback", "restore")


class StepFailed(Exception):
    """A worker failed one step of a rollout; `reason` is one line naming the worker and step."""

    def __init__(self, worker: str, step: str, reason: str, *, kind: FailureKind = FailureKind.ERROR) -> None:
        # a client's WorkerError already names the worker (and its step): not said twice
        super().__init__(reason if reason.startswith(f"worker {worker}: ") else f"worker {worker}: {step}: {reason}")
        self.worker = worker
        self.step = step
        self.reason = reason
        self.kind = kind
        self.kept_serving = False  # refused before any write and resumed: the worker is RUNNING on what it had


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _kind(exc: Exception) -> FailureKind:
    if isinstance(exc, UpdateRefused):
        return FailureKind.REFUSED
    if isinstance(exc, WorkerUnreachable):
        return FailureKind.UNREACHABLE
    return FailureKind.ERROR


class WorkerDriver:
    def __init__(
        self,
        journal: Journal,
        settings: RolloutSettings,
        restarter: Restarter,
        observers: Iterable[TransitionObserver] = (),
    ) -> None:
        self.journal = journal
        self.settings = settings
        self.restarter = restarter
        self.observers = list(observers)
        self.relauncher = Relauncher(journal, settings, restarter)  # restart rollouts (daemon.rollout.relaunch)
        self.transports: dict[int, set[str]] = {}  # rollout id -> the paths its updates took (rollouts.transport)

    # -- recording ---------------------------------------------------------------------
    def move(
        self,
        h: WorkerHandle,
        rollout_id: int | None,
        to: WorkerState,
        *,
        duration_ms: float | None,
        detail: dict[str, Any] | None = None,
        version: str | None = None,
        error: str | None = None,
        target_version: str | None = None,
    ) -> None:
        """Record `h.state -> to` (an allowed transition) and only then let the engine go on.

        Then the observers hear of it (a test entry point may hold the daemon there);
        `target_version` is the version the worker is moving to, when known.
        """
        current = h.state if h.state is not None else S.RUNNING
        check_transition(h.name, current, to)
        self.journal.transition(
            rollout_id=rollout_id,
            worker=h.name,
            from_state=current.value,
            to_state=to.value,
            duration_ms=duration_ms,
            detail=detail,
            weight_version=version,
            error=error,
        )
        h.moved(to)
        if to is S.RUNNING and version is not None and h.managed is not None:
            h.managed.record_serving(version)
        log.info(
            "worker_transition",
            worker=h.name,
            rollout=rollout_id,
            from_state=current.value,
            to_state=to.value,
            ms=None if duration_ms is None else round(duration_ms, 1),
            version=version,
            error=error,
        )
        seen = Transition(rollout_id, h.name, current, to, target_version or version)
        for observer in self.observers:
            observer(seen)

    def observed(self, h: WorkerHandle, reported: WorkerState | None, rollout_id: int | None, *,
                 version: str | None, why: str) -> None:  # fmt: skip
        """The worker reports `reported`. Where the daemon last recorded it in another state and the
        state machine allows the move (a step whose record an outage cut short, a worker the service
        resumed), the move is recorded as observed: the `workers` row never keeps a state the worker
        left. A move out of UNCERTAIN is never recorded from a report (only a re-install vouches for
        the weights); there, and where nothing differs, the handle just learns what was reported."""
        now = h.state
        if reported is None or now is None or now is S.UNCERTAIN or now == reported or reported not in ALLOWED[now]:
            h.observed(reported)
            return
        self.move(h, rollout_id, reported, duration_ms=None, detail={"observed": True, "why": why}, version=version)

    def fail(self, h: WorkerHandle, rollout_id: int | None, step: str, exc: Exception | str, t0: float) -> StepFailed:
        """Record the move to UNHEALTHY (UNCERTAIN when the failed step may have left a non-atomic
        engine partly updated) for a failed step; return the exception to raise."""
        if isinstance(exc, StepFailed):
            reason, kind = exc.reason, exc.kind
        elif isinstance(exc, Exception):
            reason, kind = str(exc), _kind(exc)
        else:
            reason, kind = exc, FailureKind.ERROR
        failed = StepFailed(h.name, step, reason, kind=kind)
        partly = step in WRITE_STEPS and kind is not FailureKind.REFUSED and not h.client.capabilities.atomic_updates
        self.move(
            h,
            rollout_id,
            S.UNCERTAIN if partly else S.UNHEALTHY,
            duration_ms=_ms(t0),
            detail={"step": step, "error": reason, "kind": kind.value},
            error=str(failed),
        )
        return failed

    # -- the normal path ---------------------------------------------------------------
    def update(
        self, h: WorkerHandle, rollout_id: int, target: Target, mode: RolloutMode, *, back: bool = False,
        prepare: bool = True, why: str | None = None,
    ) -> bool:
        """RUNNING -> DRAINING|PAUSED -> UPDATED -> RUNNING on `target`. False when already on it.

        `back`: the target is an earlier version (the client's `rollback(request)` installs it).
        `prepare`: False when the engine already prepared this worker ahead of its batch.
        `why`: the plan's reason for `mode`, recorded with the move out of RUNNING.
        Raises StepFailed after recording the move to UNHEALTHY (or UNCERTAIN).
        """
        t0 = time.perf_counter()
        try:
            info = h.client.weight_info()
        except WorkerError as exc:
            raise self.fail(h, rollout_id, "weight_info", exc, t0) from exc
        reported = parse_state(info.state)
        if reported == S.RUNNING and target.matches(info):
            self.observed(h, S.RUNNING, rollout_id, version=info.version, why="reports RUNNING on the target")
            return False
        if reported != S.RUNNING:
            h.observed(h.state or S.RUNNING)
            raise self.fail(h, rollout_id, "begin", f"worker reports state {info.state!r}, expected RUNNING", t0)
        self.observed(h, S.RUNNING, rollout_id, version=info.version, why="reports RUNNING before its update")
        restart = self.relauncher.needed(info, target)
        if restart is not None:  # other shapes than it serves: relaunched on the target instead
            refusal = self.relauncher.refusal(h, target, restart)
            if refusal is None:  # relaunched (a refusal here: a new process beside it failed, it serves on)
                refusal = self.relauncher.relaunch(self, h, rollout_id, target, mode, restart)
            if refusal is not None:
                failed = StepFailed(h.name, "update", refusal, kind=FailureKind.REFUSED)
                failed.kept_serving = True  # it never left RUNNING
                raise failed
            return True
        if prepare:
            self.prepare(h, target)
        self.begin(h, rollout_id, mode, target.version, why)
        result = self.transfer(h, rollout_id, target, back=back, resume_after=self.settings.probe_after_resume)
        self.finish(h, rollout_id, target, result=result)
        return True

    def prepare(self, h: WorkerHandle, target: Target) -> bool:
        """Let a worker that can open and validate the update's source do it while it still serves
        (issue 15: no IPC handle opened inside the pause). Best effort: a failure is only logged,
        the update then opens the source itself and gives the real answer. True when prepared."""
        if not isinstance(h.client, PreparesUpdates):
            return False
        t0 = time.perf_counter()
        try:
            h.client.prepare(target.request)
        except WorkerError as exc:
            log.warning("prepare_failed", worker=h.name, version=target.version, error=str(exc))
            return False
        log.info("worker_prepared", worker=h.name, version=target.version, ms=round(_ms(t0), 1))
        return True

    def begin(
        self, h: WorkerHandle, rollout_id: int, mode: RolloutMode, target_version: str | None, why: str | None = None
    ) -> None:
        to = BEGIN_STATE[mode]
        caps = h.client.capabilities
        t0 = time.perf_counter()
        try:
            if mode == "drain":
                if not caps.can_drain:
                    raise WorkerError(f"worker {h.name}: drain: this worker cannot drain (use mode = \"pause\")")
                h.client.drain(self.settings.drain_timeout_s)
            else:
                if not caps.pause_modes:
                    raise WorkerError(f"worker {h.name}: pause: this worker cannot pause (use mode = \"drain\")")
                h.client.pause("keep" if "keep" in caps.pause_modes else caps.pause_modes[0])
        except WorkerError as exc:
            raise self.fail(h, rollout_id, mode, exc, t0) from exc
        self.move(h, rollout_id, to, duration_ms=_ms(t0), detail={"mode": mode, **({"reason": why} if why else {})},
                  target_version=target_version)  # fmt: skip

    def transfer(
        self, h: WorkerHandle, rollout_id: int, target: Target, *, back: bool = False, resume_after: bool = False
    ) -> UpdateResult:
        """The update call. `resume_after`: a worker that can (ResumesAfterUpdate) resumes right after
        its write and probes serving, so the pause window is the write alone (issue 41); `finish`
        then finds it RUNNING and sends no resume."""
        t0 = time.perf_counter()
        try:
            if back:
                result = h.client.rollback(target.request)
            elif resume_after and isinstance(h.client, ResumesAfterUpdate):  # resumes itself, probes serving (issue 41)
                result = h.client.update_and_resume(target.request)
            else:
                result = h.client.update(target.request)
        except UpdateRefused as exc:
            raise self.refused(h, rollout_id, exc, t0) from exc
        except WorkerError as exc:
            raise self.fail(h, rollout_id, "update", exc, t0) from exc
        if result.version != target.version:
            raise self.fail(
                h, rollout_id, "update", f"worker answered version {result.version!r}, expected {target.version!r}", t0
            )
        # the path the worker really took (a vLLM without hotswap's extension reloads an ipc version from disk)
        used = str(result.detail.get("transport") or target.request.transport)
        self.transports.setdefault(rollout_id, set()).add(used)
        detail = {"version": target.version, "transport": used, "worker_ms": result.duration_ms}
        if "ranks" in result.detail:  # vLLM's extension: how many tensor-parallel ranks took the version
            detail["ranks"] = result.detail["ranks"]
        if "pause_window_ms" in result.detail:  # the worker resumed itself: its window, parked -> running
            detail["pause_window_ms"] = result.detail["pause_window_ms"]
        self.move(h, rollout_id, S.UPDATED, duration_ms=_ms(t0), detail=detail, version=target.version)
        return result

    def refused(self, h: WorkerHandle, rollout_id: int, exc: UpdateRefused, t0: float) -> StepFailed:
        """The worker refused the update before writing a parameter (a table that does not match,
        a file changed since verify, ...): it still holds what it served. Resumed there and back
        to RUNNING, recorded as a refusal, not a failure of the worker; the caller fails the
        rollout. When the worker does not confirm that (its report or resume fails), the usual
        failure path (UNHEALTHY, then restore) takes it. (A refusal means nothing was written, on
        any engine: that is the contract of UpdateRefused.)"""
        try:
            info = h.client.weight_info()
            if parse_state(info.state) not in (S.DRAINING, S.PAUSED, S.RUNNING) or not info.version:
                raise WorkerError(f"worker {h.name}: reports {info.state} on {info.version!r} after refusing")
            self.resume(h, info.state)
        except WorkerError as again:
            log.warning("refused_update_not_resumed", worker=h.name, error=str(again))
            return self.fail(h, rollout_id, "update", exc, t0)
        self.move(h, rollout_id, S.RUNNING, duration_ms=_ms(t0),
                  detail={"action": "refused", "step": "update", "kind": FailureKind.REFUSED.value, "error": str(exc),
                          "kept": info.version}, version=info.version)  # fmt: skip
        failed = StepFailed(h.name, "update", str(exc), kind=FailureKind.REFUSED)
        failed.kept_serving = True
        return failed

    def finish(
        self, h: WorkerHandle, rollout_id: int | None, target: Target, detail: dict[str, Any] | None = None,
        result: UpdateResult | None = None,
    ) -> None:
        """UPDATED -> RUNNING once weight_info and a probe show the target, then resume. The probe
        is the one the worker ran itself at the end of the update when `result` carries it."""
        t0 = time.perf_counter()
        probe = result.detail.get("probe") if result is not None else None
        try:
            probe_version, info = self._post_check(h, target.version, target.checkpoint.digest, probe)
            self.resume(h, info.state)
        except (WorkerError, StepFailed) as exc:
            raise self.fail(h, rollout_id, "post_check", exc, t0) from exc
        self.move(
            h,
            rollout_id,
            S.RUNNING,
            duration_ms=_ms(t0),
            detail={"probe_version": probe_version, "probe_by": "worker" if isinstance(probe, dict) else "daemon",
                    **(detail or {})},
            version=target.version,
        )

    def post_check(self, h: WorkerHandle, version: str, digest: str | None) -> str:
        """weight_info shows `version` (and `digest`), and a probe generation is served by it."""
        return self._post_check(h, version, digest, None)[0]

    def _post_check(self, h: WorkerHandle, version: str, digest: str | None, probe: Any) -> tuple[str, WeightInfo]:
        """`post_check`; with `probe` (the worker's own probe from its update answer: a dict with
        weight_version and finite) that result stands in for the probe generation."""
        info = h.client.weight_info()
        if info.version != version or (digest and info.digest and info.digest != digest):
            raise StepFailed(
                h.name,
                "post_check",
                f"weight_info shows version {info.version!r} digest {info.digest!r}, expected {version!r} digest {digest!r}",
                kind=FailureKind.MISMATCH,
            )
        served = _in_worker_probe(h.name, probe) if isinstance(probe, dict) else h.client.probe()
        if served != version:
            raise StepFailed(
                h.name, "post_check", f"probe generation served version {served!r}, expected {version!r}",
                kind=FailureKind.MISMATCH,
            )  # fmt: skip
        return served, info

    def resume(self, h: WorkerHandle, state: str | None = None) -> None:
        """Back to serving: resume unless the worker already reports RUNNING (e.g. freshly restarted).
        `state`: what the worker reported just now (saves asking again)."""
        if parse_state(state if state is not None else h.client.weight_info().state) != S.RUNNING:
            h.client.resume()

    def revert(self, h: WorkerHandle, rollout_id: int, mode: RolloutMode) -> None:
        """The normal path, but to the weights the worker retained by itself (`restore()`).

        Used only when the registry knows no fallback version to send; a worker that cannot
        restore by itself fails here and is restarted.
        """
        self.begin(h, rollout_id, mode, None)
        t0 = time.perf_counter()
        try:
            if not h.client.capabilities.restores_itself:
                raise WorkerError(f"worker {h.name}: rollback: no known version to go back to")
            result = h.client.restore()
        except WorkerError as exc:
            raise self.fail(h, rollout_id, "rollback", exc, t0) from exc
        self.move(h, rollout_id, S.UPDATED, duration_ms=_ms(t0), detail={"how": "worker rollback"}, version=result.version)
        t1 = time.perf_counter()
        try:
            served = self.post_check(h, result.version, None)
            self.resume(h)
        except (WorkerError, StepFailed) as exc:
            raise self.fail(h, rollout_id, "post_check", exc, t1) from exc
        self.move(h, rollout_id, S.RUNNING, duration_ms=_ms(t1), detail={"probe_version": served}, version=result.version)

    # -- the failure path --------------------------------------------------------------
def _in_worker_probe(worker: str, probe: dict[str, Any]) -> str:
    """The version a worker's own post-update probe ran under; raises as `client.probe()` would."""
    if probe.get("error"):
        raise WorkerError(f"worker {worker}: probe: {str(probe['error'])[:200]}")
    served = probe.get("weight_version")
    if probe.get("finite") is not True:
        raise NonFiniteOutput(f"worker {worker}: probe: non-finite logits under version {served}")
    return str(served)
