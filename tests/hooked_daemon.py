"""`python -m tests.hooked_daemon daemon -c CONFIG`: the daemon with test observers installed.

Production code has no test hooks; this entry point passes observers in through the daemon's
one seam (`daemon.service.run_daemon(config, observers)`), configured by environment variables
read here (never by the daemon):

  HOTSWAP_TEST_VERIFY_DELAY_S   sleep this long after a checkpoint is marked `verifying`, so a
                                test can SIGKILL the daemon mid-verify
  HOTSWAP_TEST_HOLD_STATE       hold the engine right after it records a worker moving to this
                                state (e.g. PAUSED), so a real fault can be delivered there
  HOTSWAP_TEST_HOLD_WORKER      ... only for this worker (optional)
  HOTSWAP_TEST_HOLD_VERSION     ... only while moving to this version (optional)
  HOTSWAP_TEST_HOLD_RELEASE     file whose creation ends the hold (optional; else after 600 s)

The hold fires once per daemon process and changes no state; it only waits.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from daemon.config import load_config
from daemon.registry.status import CheckpointStatus
from daemon.rollout.states import Transition
from daemon.service import Observers, run_daemon

log = structlog.get_logger("hotswap.tests.hooks")
MAX_HOLD_S = 600.0


@dataclass
class Hold:
    state: str
    worker: str | None
    version: str | None
    release: Path | None
    fired: bool = False

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, t: Transition) -> None:
        with self._lock:
            if self.fired or t.to_state.value != self.state or self.worker not in (None, t.worker):
                return
            if self.version is not None and t.version != self.version:
                return
            self.fired = True
        log.warning("test_hold_begin", worker=t.worker, state=t.to_state.value, version=t.version)
        deadline = time.monotonic() + MAX_HOLD_S
        while time.monotonic() < deadline and not (self.release is not None and self.release.exists()):
            time.sleep(0.05)
        log.warning("test_hold_end", worker=t.worker, state=t.to_state.value)


def observers_from_env() -> Observers:
    seen = Observers()
    delay = float(os.environ.get("HOTSWAP_TEST_VERIFY_DELAY_S", "0") or 0)
    if delay > 0:
        seen.statuses.append(lambda _id, st: time.sleep(delay) if st is CheckpointStatus.VERIFYING else None)
    state = os.environ.get("HOTSWAP_TEST_HOLD_STATE")
    if state:
        release = os.environ.get("HOTSWAP_TEST_HOLD_RELEASE")
        seen.transitions.append(Hold(state.upper(), os.environ.get("HOTSWAP_TEST_HOLD_WORKER") or None,
                                     os.environ.get("HOTSWAP_TEST_HOLD_VERSION") or None,
                                     Path(release) if release else None))  # fmt: skip
    return seen


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "daemon" or argv[1] not in ("-c", "--config"):
        print("usage: python -m tests.hooked_daemon daemon -c CONFIG", file=sys.stderr)
        return 2
    return run_daemon(load_config(argv[2]), observers_from_env())


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
