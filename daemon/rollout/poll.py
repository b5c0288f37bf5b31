"""The periodic health poll (an APScheduler job on the daemon's scheduler).

Keeps each idle worker's `workers` row current from its /weight_info, marks one that stops
answering UNREACHABLE (an `events` row when the state changes), relaunches a managed worker
whose process died, asks for a reconcile when a worker runs another version than the serving
one, and retries a version held back while a worker was unavailable once all are back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from daemon.adapters.base import WorkerError
from daemon.logging import get_logger
from daemon.registry.models import WORKER_STATES
from daemon.rollout.fleet import WorkerHandle
from daemon.rollout.queue import Job
from daemon.rollout.states import WorkerState, parse_state

if TYPE_CHECKING:
    from daemon.rollout.service import RolloutService

log = get_logger(__name__)


def poll(svc: RolloutService) -> None:
    """Refresh every idle worker's row from /weight_info; relaunch a dead managed worker."""
    if not svc.wait_ready(0) or svc.stopping or svc.current_job is not None:
        return  # during a job the engine itself records every state change
    drift = False
    running = 0
    for h in svc.fleet:
        if not h.busy.acquire(blocking=False):
            continue
        try:
            drift |= poll_one(svc, h)
            running += h.state == WorkerState.RUNNING
        except Exception:
            log.exception("health_poll_failed", worker=h.name)
        finally:
            h.busy.release()
    if svc.current_job is not None:
        return
    if drift:
        svc.queue.command(Job("reconcile"))
    blocked = svc.blocked
    if blocked is not None and running == len(svc.fleet):
        svc.blocked = None
        log.info("fleet_back", retrying=blocked.version)
        svc.submit(blocked.id)


def poll_one(svc: RolloutService, h: WorkerHandle) -> bool:
    if h.managed is not None and h.managed.pid is not None and not h.managed.alive():
        serving = svc.journal.alias("serving")
        log.warning("managed_worker_died", worker=h.name)
        svc.journal.observe(h.name, state="UNREACHABLE", weight_version=None, error="managed worker process exited")
        h.managed.relaunch(serving.local_path if serving else None, serving.version if serving else None)
        return False
    try:
        info = h.client.weight_info()
    except WorkerError as exc:
        svc.journal.observe(h.name, state="UNREACHABLE", weight_version=None, error=str(exc))
        h.state = None
        return False
    state = info.state if info.state in WORKER_STATES else "UNKNOWN"
    svc.journal.observe(h.name, state=state, weight_version=info.version, error=None, device=info.device)
    h.state = parse_state(info.state)
    return info.state == WorkerState.RUNNING.value and svc.serving_version is not None and info.version != svc.serving_version
