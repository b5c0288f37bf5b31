"""The per-worker state machine of a rollout (DESIGN.md, "Worker state machine").

```
RUNNING ──begin──▶ DRAINING (drain mode) | PAUSED (pause mode)
DRAINING/PAUSED ──transfer ok──▶ UPDATED
UPDATED ──post-check ok──▶ RUNNING
any ──failure──▶ UNHEALTHY ──restore last good──▶ RUNNING
UNHEALTHY ──restart command issued──▶ UNHEALTHY (stays until the worker is back)
```

Only these transitions exist; anything else raises `IllegalTransition`, so a bug
in the engine cannot write a history that skips a step.
"""

from __future__ import annotations

from enum import StrEnum


class WorkerState(StrEnum):
    RUNNING = "RUNNING"
    DRAINING = "DRAINING"
    PAUSED = "PAUSED"
    UPDATED = "UPDATED"
    UNHEALTHY = "UNHEALTHY"


S = WorkerState

ALLOWED: dict[WorkerState, frozenset[WorkerState]] = {
    S.RUNNING: frozenset({S.DRAINING, S.PAUSED, S.UNHEALTHY}),
    S.DRAINING: frozenset({S.UPDATED, S.UNHEALTHY}),
    S.PAUSED: frozenset({S.UPDATED, S.UNHEALTHY}),
    S.UPDATED: frozenset({S.RUNNING, S.UNHEALTHY}),
    # The self-loop records "restart command issued, still not back"; it is the only one.
    S.UNHEALTHY: frozenset({S.RUNNING, S.UNHEALTHY}),
}

# Where a worker goes when a rollout begins on it, by the group's mode.
BEGIN_STATE: dict[str, WorkerState] = {"drain": S.DRAINING, "pause": S.PAUSED}


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
