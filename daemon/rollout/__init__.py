"""Rollout: the mechanism that moves a host's workers between versions: the worker state
machine, rolling updates, rollback, health window and crash recovery.

Modules, in the order the data flows:

    states    the worker state machine (WorkerState, ALLOWED) and the handles carrying each
              worker's position in it (WorkerHandle, WorkerSet)
    planner   which workers leave RUNNING together, in which mode (batches)
    stage     a checkpoint -> the update request workers get, by the configured transport
    driver    one worker through the state machine: the normal path, a refused update, a
              failed step (`move` is the only way a worker's state changes)
    relaunch  restart rollouts: a worker relaunched on a version it cannot take in place
    failure   one failed worker back to RUNNING: restore the fallback, else keep its intact
              weights, else restart it
    engine    the whole fleet onto one version, and the failure path (no mixed versions)
    health    the post-deploy health window
    recovery  after a daemon crash: finish or undo the rollout that was in flight
    managed   worker processes: children the daemon runs itself, restart commands, the seed

Settings are sections of daemon.config; rows are written through daemon.registry.journal. What
to roll out and when is decided above, in daemon.controller (and daemon.fleet for a fleet);
this package never imports either.
"""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.rollout import health
    from daemon.rollout.attribution import attribute
    from daemon.rollout.driver import StepFailed, WorkerDriver
    from daemon.rollout.engine import RolloutEngine, RolloutResult
    from daemon.rollout.failure import FailurePath
    from daemon.rollout.health import HealthWatch, Stepped, WindowVerdict, step_until_done
    from daemon.rollout.managed import ManagedWorker, PortTaken, Restarter, ensure_seed, target_problem
    from daemon.rollout.planner import newer, newest
    from daemon.rollout.recovery import Recovery, check_worker, fleet_version, recover_uncertain
    from daemon.rollout.stage import (
        Stager,
        Target,
        WorkerAsks,
        ask_to_map_ahead,
        ask_to_read_ahead,
        registry_expect,
    )
    from daemon.rollout.states import (
        FAILED,
        Transition,
        TransitionObserver,
        WorkerHandle,
        WorkerSet,
        WorkerState,
        parse_state,
    )

__all__ = [
    "FAILED", "FailurePath", "HealthWatch", "ManagedWorker", "PortTaken", "Recovery", "Restarter", "RolloutEngine",
    "RolloutResult", "Stager", "StepFailed", "Stepped", "Target", "WorkerAsks", "ask_to_map_ahead", "ask_to_read_ahead", "Transition", "TransitionObserver",
    "WindowVerdict", "WorkerDriver", "WorkerHandle", "WorkerSet", "WorkerState", "attribute",
    "check_worker", "ensure_seed", "fleet_version", "health", "newer", "newest", "parse_state",
    "recover_uncertain", "registry_expect", "step_until_done", "target_problem"
]

__getattr__ = public_face(__name__)
