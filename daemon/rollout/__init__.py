"""Rollout: the worker state machine, rolling updates, rollback, health window and crash recovery.

Modules, in the order the data flows:

    states    the worker state machine (WorkerState, ALLOWED) and the handles carrying each
              worker's position in it (WorkerHandle, Fleet)
    planner   which workers leave RUNNING together, in which mode (batches)
    stage     a checkpoint -> the update request workers get, by the configured transport
    driver    one worker through the state machine: update, restore, restart (`move` is the
              only way a worker's state changes)
    engine    the whole fleet onto one version, and the failure path (no mixed versions)
    health    the post-deploy health window
    recovery  after a daemon crash: finish or undo the rollout that was in flight
    managed   worker processes: children the daemon runs itself, restart commands, the seed
    queue     the runner's bookkeeping: the job queue and RolloutState
    service   the runner: start-up, jobs (new checkpoint, rollback, pin, unpin, reconcile),
              what their results mean for the registry, and the health poll

Settings are sections of daemon.config; rows are written through daemon.registry.journal.
"""
