"""The per-worker state machine of a rollout (docs/concepts/workers.md, "Worker states"), and the handles
that carry each worker's position in it.

```
RUNNING ──begin──▶ DRAINING (drain mode) | PAUSED (pause mode)
DRAINING/PAUSED ──transfer ok──▶ UPDATED
DRAINING/PAUSED ──update refused before any write (weights untouched)──▶ RUNNING (kept serving)
UPDATED ──post-check ok──▶ RUNNING
any ──failure──▶ UNHEALTHY ──restore last good──▶ RUNNING
UNHEALTHY ──restart command issued──▶ UNHEALTHY (stays until the worker is back)
any ──failure that may have left it partly updated (engines without atomic updates)──▶ UNCERTAIN
UNCERTAIN ──known version re-installed and checked──▶ RUNNING
UNCERTAIN ──that failed too──▶ UNHEALTHY (then the restart command)
```

Only these transitions exist; anything else raises `IllegalTransition`, so a bug in the engine
cannot write a history that skips a step. The daemon owns every worker's state: a handle's
`state` changes only through `WorkerDriver.move` (recorded in `events` first) or, when the
daemon learns where a worker is without moving it (a poll, the check before a rollout, crash
recovery), through `observed()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum

from daemon.config import WorkerSpec
from daemon.engines import WorkerClient
from daemon.rollout.managed import ManagedWorker


class WorkerState(StrEnum):
    RUNNING = "RUNNING"
    DRAINING = "DRAINING"
    PAUSED = "PAUSED"
    UPDATED = "UPDATED"
    UNHEALTHY = "UNHEALTHY"
    UNCERTAIN = "UNCERTAIN"  # may be partly updated: serving nothing we can name until re-installed


S = WorkerState

ALLOWED: dict[WorkerState, frozenset[WorkerState]] = {
    S.RUNNING: frozenset({S.DRAINING, S.PAUSED, S.UNHEALTHY, S.UNCERTAIN}),
    # -> RUNNING: the worker refused the update before touching a parameter and resumed on what it served
    S.DRAINING: frozenset({S.UPDATED, S.RUNNING, S.UNHEALTHY, S.UNCERTAIN}),
    S.PAUSED: frozenset({S.UPDATED, S.RUNNING, S.UNHEALTHY, S.UNCERTAIN}),
    S.UPDATED: frozenset({S.RUNNING, S.UNHEALTHY, S.UNCERTAIN}),
    # The self-loop records "restart command issued, still not back"; it is the only one.
    S.UNHEALTHY: frozenset({S.RUNNING, S.UNHEALTHY}),
    S.UNCERTAIN: frozenset({S.RUNNING, S.UNHEALTHY}),
}
FAILED: frozenset[WorkerState] = frozenset({S.UNHEALTHY, S.UNCERTAIN})  # where a failed step leaves a worker

# Where a worker goes when a rollout begins on it, by the group's mode.
BEGIN_STATE: dict[str, WorkerState] = {"drain": S.DRAINING, "pause": S.PAUSED}


@dataclass(frozen=True, slots=True)
class Transition:
    """One recorded worker transition, as observers see it (after it was committed)."""

    rollout_id: int | None
    worker: str
    from_state: WorkerState
    to_state: WorkerState
    version: str | None  # the version the worker is moving to or reached, when known


# Called after every recorded transition, on the engine's thread. Production registers none; a
# test entry point (tests/hooked_daemon.py) uses one to hold the daemon at an exact step.
TransitionObserver = Callable[[Transition], None]


class IllegalTransition(RuntimeError):
    """The engine asked for a transition the state machine does not have."""


def parse_state(value: str | None) -> WorkerState | None:
    """A worker-reported state as a `WorkerState`, None when it is not one of ours."""
    if value is None:
        return None
    try:
        return WorkerState(value.upper())
    except ValueError:
        return None


def check_transition(worker: str, current: WorkerState, target: WorkerState) -> None:
    if target not in ALLOWED[current]:
        allowed = ", ".join(sorted(ALLOWED[current])) or "none"
        raise IllegalTransition(f"worker {worker}: {current} -> {target} is not allowed (from {current}: {allowed})")


@dataclass(eq=False)
class WorkerHandle:
    """One `[[workers]]` entry: its config, its client, its position in the state machine as the
    daemon last recorded it, and (for `launch = "managed"`) the child process the daemon runs.
    `busy` is held while the engine drives the worker, so the health poll never reports a state
    the engine is in the middle of changing. The poll and the supervisor take it only to look;
    `driven` says that whoever holds it moves the worker (`drive()`: a rollout, its failure path,
    a broadcast session), which is what the problem probe must know."""

    spec: WorkerSpec
    client: WorkerClient
    url: str
    managed: ManagedWorker | None = None
    _state: WorkerState | None = None  # None = not known yet
    busy: threading.Lock = field(default_factory=threading.Lock)
    driven: bool = False
    # monotonic times: its state last changed, and it last left RUNNING (how long a pause has held
    # its requests, how long a step has taken: daemon.controller.problems)
    changed_at: float = field(default_factory=time.monotonic)
    left_running_at: float = field(default_factory=time.monotonic)

    @contextmanager
    def drive(self) -> Iterator[None]:
        """Hold `busy` to move the worker (not only to look at it)."""
        with self.busy:
            self.driven = True
            try:
                yield
            finally:
                self.driven = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def state(self) -> WorkerState | None:
        return self._state

    def moved(self, to: WorkerState) -> None:
        """Only `WorkerDriver.move` calls this, after the transition was checked and recorded."""
        self._set(to)

    def observed(self, state: WorkerState | None) -> None:
        """The daemon learned where the worker is (its own report) without moving it."""
        self._set(state)

    def _set(self, state: WorkerState | None) -> None:
        if state != self._state:
            now = time.monotonic()
            if self._state is WorkerState.RUNNING:
                self.left_running_at = now
            self.changed_at = now
        self._state = state


class WorkerSet:
    """One host's workers, by name (a fleet, daemon/fleet/, is many hosts)."""

    def __init__(self, handles: list[WorkerHandle]) -> None:
        self._handles = {h.name: h for h in handles}
        self.specs = [h.spec for h in handles]

    def __iter__(self) -> Iterator[WorkerHandle]:
        return iter(self._handles.values())

    def __len__(self) -> int:
        return len(self._handles)

    def __getitem__(self, name: str) -> WorkerHandle:
        return self._handles[name]

    def names(self) -> list[str]:
        return list(self._handles)

    def close(self) -> None:
        for h in self:
            h.client.close()
