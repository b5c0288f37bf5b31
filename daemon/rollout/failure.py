"""The failure path of one worker: back to RUNNING after a step of its rollout failed.

The driver (daemon.rollout.driver) records the failed step (UNHEALTHY, or UNCERTAIN when it may
have left a non-atomic engine partly updated); `restore` then installs the fallback version (its
update request, installed and checked). When that cannot be done but the worker still serves a
verified version whole, it goes back to RUNNING on that: a worker with intact weights is never
left out of rotation. Else `restart` runs the restart command (or relaunches a managed worker)
and waits until the worker is healthy again; "restarting" is recorded only when one was issued.
`recover` is the two in that order. Every state change goes through the driver's `move`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from daemon.common import get_logger
from daemon.engines import WeightInfo, WorkerError
from daemon.rollout.driver import StepFailed, WorkerDriver
from daemon.rollout.stage import Target
from daemon.rollout.states import FAILED, WorkerHandle, WorkerState, parse_state

log = get_logger(__name__)
S = WorkerState


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


class FailurePath:
    """Restore, restart and recover one failed worker, recorded through `driver.move`."""

    def __init__(self, driver: WorkerDriver) -> None:
        self.driver = driver

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
                self.driver.post_check(h, fallback_version, None)
            else:
                if h.state == S.UNCERTAIN or not fallback.matches(info):
                    if parse_state(info.state) == S.RUNNING and caps.pause_modes:
                        # The transfer needs the worker out of RUNNING; pause keeps its queue.
                        h.client.pause("keep" if "keep" in caps.pause_modes else caps.pause_modes[0])
                    h.client.rollback(fallback.request)
                    how = f"update to {fallback.version} ({fallback.request.transport})"
                self.driver.post_check(h, fallback.version, fallback.checkpoint.digest)
                fallback_version = fallback.version
            self.driver.resume(h)
        except (WorkerError, StepFailed) as exc:
            log.warning("restore_failed", worker=h.name, error=str(exc))
            kept = self._intact(h, avoid)
            if kept is not None:  # the fallback cannot be installed, but what it serves is whole
                self.driver.move(h, rollout_id, S.RUNNING, duration_ms=_ms(t0),
                          detail={"action": "restored", "restored_to": kept, "how": "kept its intact weights",
                                  "fallback_failed": str(exc), "why": why}, version=kept)  # fmt: skip
                return True
            self.driver.move(h, rollout_id, S.UNHEALTHY, duration_ms=_ms(t0),
                      detail={"action": "restore_failed", "error": str(exc), "why": why},
                      error=f"restore failed: {exc}")  # fmt: skip
            return False
        self.driver.move(
            h,
            rollout_id,
            S.RUNNING,
            duration_ms=_ms(t0),
            detail={"action": "restored", "restored_to": fallback_version, "how": how, "why": why},
            version=fallback_version,
        )
        return True

    def _intact(self, h: WorkerHandle, avoid: str | None) -> str | None:
        """The version a failed (not UNCERTAIN) worker still serves whole, resumed: a verified
        version other than `avoid`, with the registry's digest when the worker reports one, and
        a probe that answers. None when that cannot be shown."""
        if h.state != S.UNHEALTHY:
            return None  # UNCERTAIN: its weights may be a mix; only a re-install brings it back
        try:
            info = h.client.weight_info()
            ref = self.driver.journal.checkpoint_by_version(info.version) if info.version else None
            if (ref is None or not ref.verified or info.version == avoid
                    or parse_state(info.state) not in (S.RUNNING, S.DRAINING, S.PAUSED)
                    or (info.digest is not None and ref.digest is not None and info.digest != ref.digest)):  # fmt: skip
                return None
            self.driver.resume(h, info.state)
            self.driver.post_check(h, ref.version, ref.digest)
        except (WorkerError, StepFailed) as exc:
            log.warning("intact_check_failed", worker=h.name, error=str(exc))
            return None
        return ref.version

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
        outcome = self.driver.restarter.restart(h.spec, h.url, h.managed, fallback.checkpoint if fallback else None)
        issued = bool(outcome.get("issued"))
        if not issued:
            log.error("worker_not_restarted", worker=h.name, reason=outcome.get("error"), why=why)
        self.driver.move(
            h,
            rollout_id,
            S.UNHEALTHY,
            duration_ms=_ms(t0),
            detail={"action": "restart" if issued else "not_restarted", "why": why, **outcome},
            error=f"restarting: {why}" if issued else f"not restarted ({outcome.get('error') or 'no way to'}): {why}",
        )
        if not issued:
            return False
        t1 = time.perf_counter()
        info = self.wait_answering(h, self.driver.settings.restart_timeout_s)
        if info is None:
            exited = h.managed is not None and not h.managed.alive()
            error = "the relaunched worker exited" if exited else f"not back {self.driver.settings.restart_timeout_s:.0f} s after restart"
            self.driver.move(h, rollout_id, S.UNHEALTHY, duration_ms=_ms(t1),
                      detail={"action": "restart_timeout", "waited_s": round(time.perf_counter() - t1, 1),
                              **({"exited": True} if exited else {})},
                      error=error)  # fmt: skip
            return False
        return self.restore(h, rollout_id, fallback, f"{why}; restarted", avoid)

    def wait_answering(self, h: WorkerHandle, timeout_s: float, want: Callable[[WeightInfo], bool] | None = None) -> WeightInfo | None:
        """Poll weight_info until the worker answers in RUNNING (and `want` holds), or time out;
        None at once when a managed child exited (the supervisor reports why: daemon/controller/supervise.py)."""
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
