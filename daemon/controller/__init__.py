"""The host's rollout controller: decides which version the local workers should serve and keeps
them there, compared against what the workers report on every pass.

    service        RolloutService: the one job runner (inputs, runner thread, status, the
                   health poll)
    decisions      its jobs (new checkpoint, rollback, pin, unpin, converge, reconcile) and what
                   their results mean for the registry (serving, last_good, rejected, retried)
    health_window  the one health window of every served name (the base, each adapter name)
                   after a rollout, and its verdict (last_good, or rejected or retried and
                   rolled back)
    served         the one writer of serving and last_good, the base's and each adapter name's
    startup        the seed, managed workers launched, crash recovery, before the first job
    commands       each job the runner can be asked to do, one small class each, that runs itself
    queue          the runner's job queue and its state (what runs, what waits)
    supervise      managed worker processes: launch, watch, relaunch with backoff, fallback versions
    problems       what is wrong with the host's workers and rollouts (for daemon.process.health)
    adapters       LoRA adapters' jobs, per adapter name (deploy, rollback, pin, unpin, reconcile)
    adapter_rollout  one adapter version onto every worker with no pause, undone on failure
    broadcast      a trainer's broadcast session as a rollout: workers with the broadcast
                   capability paused, joined to its group, fed, checked, resumed or put back

The mechanism it drives (moving workers between versions) is daemon.rollout; the fleet's target
comes from daemon.fleet. Nothing below imports it; the API and daemon.service do.
"""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.controller.broadcast import BroadcastSessions, Refusal
    from daemon.controller.poll import PollCollector
    from daemon.controller.problems import (
        Controlled,
        WorkerProbe,
        alias_problems,
        groups_serving,
        last_rollout_problem,
    )
    from daemon.controller.queue import CommandError
    from daemon.controller.service import RolloutService

__all__ = [
    "BroadcastSessions", "CommandError", "Controlled", "PollCollector", "Refusal", "RolloutService",
    "WorkerProbe", "alias_problems", "groups_serving", "last_rollout_problem"
]

__getattr__ = public_face(__name__)
