"""One worker through the state machine: update, restore, restart, and pick up after a crash.

Every transition is committed to `events` (with the step's duration) before the
next step starts. A step that fails moves the worker to UNHEALTHY and raises
`StepFailed`; the engine then calls `restore` (back to the fallback version over
the admin API, by the same transport) and, if that fails too, `restart` (the
configured restart command, then wait until the worker is healthy again).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.adapters.base import UpdateRefused, UpdateRequest, WeightInfo, WorkerError, WorkerUnreachable
from daemon.logging import get_logger
from daemon.rollout.faults import Faults
from daemon.rollout.fleet import WorkerHandle
from daemon.rollout.journal import CheckpointRef, Journal
from daemon.rollout.restart import Restarter
from daemon.rollout.settings import RolloutMode, RolloutSettings
from daemon.rollout.states import BEGIN_STATE, WorkerState, check_transition, parse_state

log = get_logger(__name__)
S = WorkerState


class StepFailed(Exception):
    """A worker failed one step of a rollout; `reason` is one line naming the worker and step."""

    def __init__(self, worker: str, step: str, reason: str, *, kind: str = "error") -> None:
        super().__init__(f"worker {worker}: {step}: {reason}")
        self.worker = worker
        self.step = step
        self.reason = reason
        self.kind = kind  # refused | unreachable | mismatch | error


@dataclass(frozen=True, slots=True)
class Target:
    """A version to put on a worker and the request that carries it (disk path or ipc descriptor)."""

    checkpoint: CheckpointRef
    request: UpdateRequest

    @property
    def version(self) -> str:
        return self.checkpoint.version

    def matches(self, info: WeightInfo) -> bool:
        if info.version != self.checkpoint.version:
            return False
        return not (self.checkpoint.digest and info.digest and info.digest != self.checkpoint.digest)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _kind(exc: Exception) -> str:
    if isinstance(exc, UpdateRefused):
        return "refused"
    if isinstance(exc, WorkerUnreachable):
        return "unreachable"
    return "error"


class WorkerDriver:
    def __init__(self, journal: Journal, settings: RolloutSettings, restarter: Restarter, faults: Faults) -> None:
        self.journal = journal
        self.settings = settings
        self.restarter = restarter
        self.faults = faults

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
        """Record `h.state -> to` (an allowed transition) and only then let the engine go on."""
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
        h.state = to
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
        self.faults.after_transition(h.name, to.value, target_version or version)

    def fail(self, h: WorkerHandle, rollout_id: int | None, step: str, exc: Exception | str, t0: float) -> StepFailed:
        """Record the move to UNHEALTHY for a failed step; return the exception to raise."""
        if isinstance(exc, StepFailed):
            reason, kind = exc.reason, exc.kind
        elif isinstance(exc, Exception):
            reason, kind = str(exc), _kind(exc)
        else:
            reason, kind = exc, "error"
        failed = StepFailed(h.name, step, reason, kind=kind)
        self.move(
            h,
            rollout_id,
            S.UNHEALTHY,
            duration_ms=_ms(t0),
            detail={"step": step, "error": reason, "kind": kind},
            error=str(failed),
        )
        return failed

    # -- the normal path ---------------------------------------------------------------
    def update(self, h: WorkerHandle, rollout_id: int, target: Target, mode: RolloutMode) -> bool:
        """RUNNING -> DRAINING|PAUSED -> UPDATED -> RUNNING on `target`. False when already on it.

        Raises StepFailed after recording the move to UNHEALTHY.
        """
        t0 = time.perf_counter()
        try:
            info = h.client.weight_info()
        except WorkerError as exc:
            raise self.fail(h, rollout_id, "weight_info", exc, t0) from exc
        reported = parse_state(info.state)
        if reported == S.RUNNING and target.matches(info):
            h.state = S.RUNNING
            return False
        if reported != S.RUNNING:
            h.state = h.state or S.RUNNING
            raise self.fail(h, rollout_id, "begin", f"worker reports state {info.state!r}, expected RUNNING", t0)
        h.state = S.RUNNING
        self.begin(h, rollout_id, mode, target.version)
        self.transfer(h, rollout_id, target)
        self.finish(h, rollout_id, target)
        return True

    def begin(self, h: WorkerHandle, rollout_id: int, mode: RolloutMode, target_version: str | None) -> None:
        to = BEGIN_STATE[mode]
        t0 = time.perf_counter()
        try:
            if mode == "drain":
                h.client.drain(self.settings.drain_timeout_s)
            else:
                h.client.pause("keep")
        except WorkerError as exc:
            raise self.fail(h, rollout_id, mode, exc, t0) from exc
        self.move(h, rollout_id, to, duration_ms=_ms(t0), detail={"mode": mode}, target_version=target_version)

    def transfer(self, h: WorkerHandle, rollout_id: int, target: Target) -> None:
        t0 = time.perf_counter()
        try:
            result = h.client.update(target.request)
        except WorkerError as exc:
            raise self.fail(h, rollout_id, "update", exc, t0) from exc
        if result.version != target.version:
            raise self.fail(
                h, rollout_id, "update", f"worker answered version {result.version!r}, expected {target.version!r}", t0
            )
        detail = {"version": target.version, "transport": target.request.transport, "worker_ms": result.duration_ms}
        self.move(h, rollout_id, S.UPDATED, duration_ms=_ms(t0), detail=detail, version=target.version)

    def finish(self, h: WorkerHandle, rollout_id: int | None, target: Target, detail: dict[str, Any] | None = None) -> None:
        """UPDATED -> RUNNING once weight_info and a probe generation show the target, then resume."""
        t0 = time.perf_counter()
        try:
            probe_version = self.post_check(h, target.version, target.checkpoint.digest)
            self.resume(h)
        except (WorkerError, StepFailed) as exc:
            raise self.fail(h, rollout_id, "post_check", exc, t0) from exc
        self.move(
            h,
            rollout_id,
            S.RUNNING,
            duration_ms=_ms(t0),
            detail={"probe_version": probe_version, **(detail or {})},
            version=target.version,
        )

    def post_check(self, h: WorkerHandle, version: str, digest: str | None) -> str:
        """weight_info shows `version` (and `digest`), and a probe generation is served by it."""
        info = h.client.weight_info()
        if info.version != version or (digest and info.digest and info.digest != digest):
            raise StepFailed(
                h.name,
                "post_check",
                f"weight_info shows version {info.version!r} digest {info.digest!r}, expected {version!r} digest {digest!r}",
                kind="mismatch",
            )
        served = h.client.probe()
        if served != version:
            raise StepFailed(
                h.name, "post_check", f"probe generation served version {served!r}, expected {version!r}", kind="mismatch"
            )
        return served

    def resume(self, h: WorkerHandle) -> None:
        """Back to serving: resume unless the worker already reports RUNNING (e.g. freshly restarted)."""
        if parse_state(h.client.weight_info().state) != S.RUNNING:
            h.client.resume()

    def revert(self, h: WorkerHandle, rollout_id: int, mode: RolloutMode) -> None:
        """The normal path, but to the worker's own retained previous version (/admin/rollback).

        Used only when the registry knows no fallback version to send.
        """
        self.begin(h, rollout_id, mode, None)
        t0 = time.perf_counter()
        try:
            result = h.client.rollback()
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
        """UNHEALTHY -> RUNNING on `fallback` over the admin API. False when the worker cannot be restored.

        With no known fallback, a worker serving `avoid` (the version being rolled out) goes
        back to its own retained previous version (/admin/rollback); any other keeps its weights.
        """
        assert h.state == S.UNHEALTHY, h.state
        t0 = time.perf_counter()
        how = "unchanged"
        try:
            info = h.client.weight_info()
            if parse_state(info.state) == S.UNHEALTHY:
                # The worker's own write failed and could not be undone: it restores its retained
                # last good weights first (the only call it takes in that state).
                how = f"worker rollback to {h.client.rollback().version}"
                info = h.client.weight_info()
            if fallback is None:
                fallback_version = info.version or ""
                if avoid is not None and info.version == avoid:
                    fallback_version = h.client.rollback().version
                    how = f"worker rollback to {fallback_version}"
                self.post_check(h, fallback_version, None)
            else:
                if not fallback.matches(info):
                    if parse_state(info.state) == S.RUNNING:
                        # The transfer needs the worker out of RUNNING; pause keeps its queue.
                        h.client.pause("keep")
                    h.client.update(fallback.request)
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
        outcome = self.restarter.restart(h, fallback.checkpoint if fallback else None)
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
            self.move(h, rollout_id, S.UNHEALTHY, duration_ms=_ms(t1),
                      detail={"action": "restart_timeout", "waited_s": self.settings.restart_timeout_s},
                      error=f"not back {self.settings.restart_timeout_s:.0f} s after restart")  # fmt: skip
            return False
        return self.restore(h, rollout_id, fallback, f"{why}; restarted", avoid)

    def wait_answering(self, h: WorkerHandle, timeout_s: float, want: Callable[[WeightInfo], bool] | None = None) -> WeightInfo | None:
        """Poll weight_info until the worker answers in RUNNING (and `want` holds), or time out."""
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while time.monotonic() < deadline:
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
        """From UNHEALTHY: restore, else restart. True once the worker is RUNNING again."""
        if self.restore(h, rollout_id, fallback, why, avoid):
            return True
        return self.restart(h, rollout_id, fallback, why, avoid)
