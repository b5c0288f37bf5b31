"""One worker through the state machine: update, restore, restart, and pick up after a crash.

Every transition is committed to `events` (with the step's duration) before the next step
starts; `move` is the only way a worker's state changes. A step that fails moves the worker to
UNHEALTHY (or UNCERTAIN, when the step may have changed weights on an engine without atomic
updates) and raises `StepFailed`; the engine then calls `restore` (back to the fallback version:
the fallback's update request, installed and checked) and, if that fails too, `restart` (the
configured restart command, then wait until the worker is healthy again).

What a worker can do comes from its client's `capabilities` (pause modes, drain, whether it
restores by itself, whether its updates are atomic); the driver never asks its kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from daemon.adapters.base import (
    NonFiniteOutput,
    PreparesUpdates,
    UpdateRefused,
    UpdateResult,
    WeightInfo,
    WorkerError,
    WorkerUnreachable,
)
from daemon.config import RolloutMode, RolloutSettings
from daemon.logging import get_logger
from daemon.registry.journal import Journal
from daemon.registry.status import FailureKind
from daemon.rollout.managed import Restarter
from daemon.rollout.stage import Target
from daemon.rollout.states import (
    BEGIN_STATE,
    FAILED,
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
        prepare: bool = True,
    ) -> bool:
        """RUNNING -> DRAINING|PAUSED -> UPDATED -> RUNNING on `target`. False when already on it.

        `back`: the target is an earlier version (the client's `rollback(request)` installs it).
        `prepare`: False when the engine already prepared this worker ahead of its batch.
        Raises StepFailed after recording the move to UNHEALTHY (or UNCERTAIN).
        """
        t0 = time.perf_counter()
        try:
            info = h.client.weight_info()
        except WorkerError as exc:
            raise self.fail(h, rollout_id, "weight_info", exc, t0) from exc
        reported = parse_state(info.state)
        if reported == S.RUNNING and target.matches(info):
            h.observed(S.RUNNING)
            return False
        if reported != S.RUNNING:
            h.observed(h.state or S.RUNNING)
            raise self.fail(h, rollout_id, "begin", f"worker reports state {info.state!r}, expected RUNNING", t0)
        h.observed(S.RUNNING)
        if prepare:
            self.prepare(h, target)
        self.begin(h, rollout_id, mode, target.version)
        result = self.transfer(h, rollout_id, target, back=back)
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

    def begin(self, h: WorkerHandle, rollout_id: int, mode: RolloutMode, target_version: str | None) -> None:
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
        self.move(h, rollout_id, to, duration_ms=_ms(t0), detail={"mode": mode}, target_version=target_version)

    def transfer(self, h: WorkerHandle, rollout_id: int, target: Target, *, back: bool = False) -> UpdateResult:
        t0 = time.perf_counter()
        try:
            result = h.client.rollback(target.request) if back else h.client.update(target.request)
        except WorkerError as exc:
            raise self.fail(h, rollout_id, "update", exc, t0) from exc
        if result.version != target.version:
            raise self.fail(
                h, rollout_id, "update", f"worker answered version {result.version!r}, expected {target.version!r}", t0
            )
        detail = {"version": target.version, "transport": target.request.transport, "worker_ms": result.duration_ms}
        self.move(h, rollout_id, S.UPDATED, duration_ms=_ms(t0), detail=detail, version=target.version)
        return result

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
    def restore(
        self, h: WorkerHandle, rollout_id: int | None, fallback: Target | None, why: str, avoid: str | None = None
    ) -> bool:
        """UNHEALTHY/UNCERTAIN -> RUNNING on `fallback`: its request installed, then checked.
        False when the worker cannot be restored.

        With no known fallback, a worker serving `avoid` (the version being rolled out) goes
        back to the weights it retained itself, if it can; any other keeps its weights.
        """
        assert h.state in FAILED, h.state
        caps = h.client.capabilities
        t0 = time.perf_counter()
        how = "unchanged"
        try:
            info = h.client.weight_info()
            if parse_state(info.state) == S.UNHEALTHY and caps.restores_itself:
                # The worker's own write failed and could not be undone: it restores its retained
                # last good weights first (the only call it takes in that state).
                how = f"worker rollback to {h.client.restore().version}"
                info = h.client.weight_info()
            if fallback is None:
                fallback_version = info.version or ""
                if h.state == S.UNCERTAIN or (avoid is not None and info.version == avoid):
                    if not caps.restores_itself:
                        raise WorkerError(f"worker {h.name}: no known version to re-install")
                    fallback_version = h.client.restore().version
                    how = f"worker rollback to {fallback_version}"
                self.post_check(h, fallback_version, None)
            else:
                if h.state == S.UNCERTAIN or not fallback.matches(info):
                    if parse_state(info.state) == S.RUNNING and caps.pause_modes:
                        # The transfer needs the worker out of RUNNING; pause keeps its queue.
                        h.client.pause("keep" if "keep" in caps.pause_modes else caps.pause_modes[0])
                    h.client.rollback(fallback.request)
                    how = f"update to {fallback.version} ({fallback.request.transport})"
                self.post_check(h, fallback.version, fallback.checkpoint.digest)
                fallback_version = fallback.version
            self.resume(h)
        except (WorkerError, StepFailed) as exc:
            log.warning("restore_failed", worker=h.name, error=str(exc))
            self.move(h, rollout_id, S.UNHEALTHY, duration_ms=_ms(t0),
                      detail={"action": "restore_failed", "error": str(exc), "why": why},
                      error=f"restore failed: {exc}")  # fmt: skip
            return False
        self.move(
            h,
            rollout_id,
            S.RUNNING,
            duration_ms=_ms(t0),
            detail={"action": "restored", "restored_to": fallback_version, "how": how, "why": why},
            version=fallback_version,
        )
        return True

    def restart(
        self, h: WorkerHandle, rollout_id: int | None, fallback: Target | None, why: str, avoid: str | None = None
    ) -> bool:
        """Run the restart command, then wait (bounded) until the worker is RUNNING on `fallback`.

        Records UNHEALTHY -> UNHEALTHY (restart issued) and, once it is back,
        UNHEALTHY -> RUNNING. False when it is not back in `restart_timeout_s`:
        it stays UNHEALTHY and the health poll keeps watching it.
        """
        assert h.state == S.UNHEALTHY, h.state
        t0 = time.perf_counter()
        outcome = self.restarter.restart(h.spec, h.url, h.managed, fallback.checkpoint if fallback else None)
        self.move(
            h,
            rollout_id,
            S.UNHEALTHY,
            duration_ms=_ms(t0),
            detail={"action": "restart", "why": why, **outcome},
            error=f"restarting: {why}",
        )
        if not outcome.get("issued"):
            return False
        t1 = time.perf_counter()
        info = self.wait_answering(h, self.settings.restart_timeout_s)
        if info is None:
            exited = h.managed is not None and not h.managed.alive()
            error = "the relaunched worker exited" if exited else f"not back {self.settings.restart_timeout_s:.0f} s after restart"
            self.move(h, rollout_id, S.UNHEALTHY, duration_ms=_ms(t1),
                      detail={"action": "restart_timeout", "waited_s": round(time.perf_counter() - t1, 1),
                              **({"exited": True} if exited else {})},
                      error=error)  # fmt: skip
            return False
        return self.restore(h, rollout_id, fallback, f"{why}; restarted", avoid)

    def wait_answering(self, h: WorkerHandle, timeout_s: float, want: Callable[[WeightInfo], bool] | None = None) -> WeightInfo | None:
        """Poll weight_info until the worker answers in RUNNING (and `want` holds), or time out;
        None at once when a managed child exited (the supervisor reports why: daemon/supervise.py)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while time.monotonic() < deadline:
            if h.managed is not None and h.managed.should_run and not h.managed.alive():
                return None
            try:
                info = h.client.weight_info()
                if parse_state(info.state) == S.RUNNING and (want is None or want(info)):
                    return info
            except WorkerError:
                pass
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)
        return None

    def recover(
        self, h: WorkerHandle, rollout_id: int | None, why: str, fallback: Target | None, avoid: str | None = None
    ) -> bool:
        """From UNHEALTHY or UNCERTAIN: restore, else restart. True once the worker is RUNNING again."""
        if self.restore(h, rollout_id, fallback, why, avoid):
            return True
        return self.restart(h, rollout_id, fallback, why, avoid)


def _in_worker_probe(worker: str, probe: dict[str, Any]) -> str:
    """The version a worker's own post-update probe ran under; raises as `client.probe()` would."""
    if probe.get("error"):
        raise WorkerError(f"worker {worker}: probe: {str(probe['error'])[:200]}")
    served = probe.get("weight_version")
    if probe.get("finite") is not True:
        raise NonFiniteOutput(f"worker {worker}: probe: non-finite logits under version {served}")
    return str(served)
