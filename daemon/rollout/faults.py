"""TEST-ONLY fault-injection hook: hold the engine right after it records a given transition.

Never set these in production. The fault tests use them to freeze the daemon at
an exact point (a worker DRAINING, PAUSED or UPDATED) so that a real fault can
be delivered there: the test SIGKILLs the daemon or the worker, then (if the
daemon is still alive) creates the release file. The hold itself changes no
state; it only waits.

  HOTSWAP_TEST_HOLD_STATE    state whose transition triggers the hold (e.g. PAUSED); unset = no hook
  HOTSWAP_TEST_HOLD_WORKER   only for this worker (optional)
  HOTSWAP_TEST_HOLD_VERSION  only while moving to this version (optional)
  HOTSWAP_TEST_HOLD_RELEASE  file whose creation ends the hold (optional; else it ends after 600 s)

The hook fires once per daemon process.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("hotswap.rollout.faults")

MAX_HOLD_S = 600.0


@dataclass
class HoldHook:
    state: str
    worker: str | None
    version: str | None
    release: Path | None
    fired: bool = False

    @classmethod
    def from_env(cls) -> HoldHook | None:
        state = os.environ.get("HOTSWAP_TEST_HOLD_STATE")
        if not state:
            return None
        release = os.environ.get("HOTSWAP_TEST_HOLD_RELEASE")
        return cls(
            state=state.upper(),
            worker=os.environ.get("HOTSWAP_TEST_HOLD_WORKER") or None,
            version=os.environ.get("HOTSWAP_TEST_HOLD_VERSION") or None,
            release=Path(release) if release else None,
        )

    def matches(self, worker: str, state: str, version: str | None) -> bool:
        return (
            not self.fired
            and state == self.state
            and (self.worker is None or worker == self.worker)
            and (self.version is None or version == self.version)
        )


class Faults:
    """The engine calls `after_transition` after every recorded transition; a no-op unless a hook is set."""

    def __init__(self, hold: HoldHook | None = None) -> None:
        self.hold = hold
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> Faults:
        return cls(HoldHook.from_env())

    def after_transition(self, worker: str, state: str, version: str | None) -> None:
        hook = self.hold
        if hook is None:
            return
        with self._lock:
            if not hook.matches(worker, state, version):
                return
            hook.fired = True
        log.warning("test_hold_begin", worker=worker, state=state, version=version, release=str(hook.release))
        deadline = time.monotonic() + MAX_HOLD_S
        while time.monotonic() < deadline:
            if hook.release is not None and hook.release.exists():
                break
            time.sleep(0.05)
        log.warning("test_hold_end", worker=worker, state=state)
