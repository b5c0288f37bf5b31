"""`python -m tests.hooked_daemon daemon -c CONFIG`: the daemon with test observers installed.

Production code has no test hooks; this entry point passes observers in through the daemon's
one seam (`daemon.service.run_daemon(config, observers)`), configured by environment variables
read here (never by the daemon):

  HOTSWAP_TEST_VERIFY_DELAY_S   sleep this long after a checkpoint is marked `verifying`, so a
                                test can SIGKILL the daemon mid-verify
  HOTSWAP_TEST_HOLD_STATE       hold the engine right after it records a worker moving to this
                                state (e.g. PAUSED), so a real fault can be delivered there
  HOTSWAP_TEST_HOLD_WORKER      ... only for this worker (optional)
  HOTSWAP_TEST_HOLD_VERSION     ... only while moving to this version (optional); "v4,v5": once
                                for each, each ended by its own file RELEASE.v4, RELEASE.v5
  HOTSWAP_TEST_HOLD_RELEASE     file whose creation ends the hold (optional; else after 600 s)
  HOTSWAP_TEST_HOLD_EVERY       "1": hold at every such move, not once; the n-th (from 1) ends
                                with its own file RELEASE.n
  HOTSWAP_TEST_START_GATE       a file path: the process (its imports done) creates GATE.<pid>.waiting,
                                then starts the daemon only once GATE exists, so a test can start
                                several daemons at the same instant (at most 600 s)

The hold fires once per daemon process (per listed version), or every time with
HOTSWAP_TEST_HOLD_EVERY, and changes no state; it only waits.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
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
    versions: tuple[str, ...]  # () = any version, once
    release: Path | None
    every: bool = False
    fired: set[str | int | None] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def _release_file(self, key: str | int | None) -> Path | None:
        if self.release is None or (len(self.versions) < 2 and not self.every):
            return self.release
        return self.release.with_name(f"{self.release.name}.{key}")

    def __call__(self, t: Transition) -> None:
        with self._lock:
            if t.to_state.value != self.state or self.worker not in (None, t.worker):
                return
            if self.versions and t.version not in self.versions:
                return
            key: str | int | None = len(self.fired) + 1 if self.every else t.version if self.versions else None
            if key in self.fired:
                return
            self.fired.add(key)
        release = self._release_file(key)
        log.warning("test_hold_begin", worker=t.worker, state=t.to_state.value, version=t.version)
        deadline = time.monotonic() + MAX_HOLD_S
        while time.monotonic() < deadline and not (release is not None and release.exists()):
            time.sleep(0.05)
        log.warning("test_hold_end", worker=t.worker, state=t.to_state.value, version=t.version)


def observers_from_env() -> Observers:
    seen = Observers()
    delay = float(os.environ.get("HOTSWAP_TEST_VERIFY_DELAY_S", "0") or 0)
    if delay > 0:
        seen.statuses.append(lambda _id, st: time.sleep(delay) if st is CheckpointStatus.VERIFYING else None)
    state = os.environ.get("HOTSWAP_TEST_HOLD_STATE")
    if state:
        release = os.environ.get("HOTSWAP_TEST_HOLD_RELEASE")
        versions = tuple(v for v in os.environ.get("HOTSWAP_TEST_HOLD_VERSION", "").split(",") if v)
        seen.transitions.append(Hold(state.upper(), os.environ.get("HOTSWAP_TEST_HOLD_WORKER") or None, versions,
                                     Path(release) if release else None,
                                     os.environ.get("HOTSWAP_TEST_HOLD_EVERY", "") == "1"))  # fmt: skip
    return seen


def wait_at_gate(gate: Path) -> None:
    Path(f"{gate}.{os.getpid()}.waiting").touch()
    deadline = time.monotonic() + MAX_HOLD_S
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.005)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "daemon" or argv[1] not in ("-c", "--config"):
        print("usage: python -m tests.hooked_daemon daemon -c CONFIG", file=sys.stderr)
        return 2
    gate = os.environ.get("HOTSWAP_TEST_START_GATE")
    if gate:
        wait_at_gate(Path(gate))
    return run_daemon(load_config(argv[2]), observers_from_env())


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
