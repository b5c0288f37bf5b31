"""Start-up of the rollout runner: seed and launch managed workers, then crash recovery.

Runs first on the runner's thread (the seed is made earlier, on the caller's thread), before
any queued checkpoint: unfinished rollouts are finished or undone, an interrupted health
window is watched again, drifted workers are reconciled and a waiting version is resumed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from daemon.logging import get_logger
from daemon.rollout.engine import RolloutResult
from daemon.rollout.journal import CheckpointRef, RolloutRef
from daemon.rollout.managed import ensure_seed
from daemon.rollout.queue import Job
from daemon.rollout.recovery import Recovery

if TYPE_CHECKING:
    from daemon.rollout.service import RolloutService

log = get_logger(__name__)


def bootstrap(svc: RolloutService) -> None:
    pinned = svc.journal.alias("pinned")
    svc.pinned = pinned.version if pinned else None
    serving = launch_managed(svc)
    svc.serving_version = serving.version if serving else None
    open_rollouts = svc.journal.unfinished_rollouts()
    for r in open_rollouts[:-1]:
        svc.journal.finish_rollout(r.id, "failed", {"reason": "left unfinished; a later rollout replaced it"})
    if open_rollouts:
        recover_unfinished(svc, open_rollouts[-1])
    else:
        serving = svc.journal.alias("serving")
        last_good = svc.journal.alias("last_good")
        rid = svc.journal.last_rollout_of(serving.id) if serving else None
        if serving is not None and rid is not None and (last_good is None or last_good.id != serving.id):
            # The daemon stopped inside a health window: watch again before trusting the version.
            log.info("health_window_resumed", version=serving.version)
            svc.health_window(serving, rid, last_good)
    svc.queue.command(Job("reconcile"))
    serving = svc.journal.alias("serving")
    waiting = svc.journal.newest_waiting(serving.id if serving else 0)
    if waiting is not None:
        log.info("resuming_waiting_checkpoint", version=waiting.version)
        svc.submit(waiting.id)


def seed_if_empty(svc: RolloutService) -> None:
    """A fleet of managed workers only, with nothing deployed yet: serve the tiny seed."""
    managed = [h for h in svc.fleet if h.managed is not None]
    if not managed or len(managed) != len(svc.fleet) or any(h.spec.model for h in managed):
        return
    if svc.journal.alias("serving") is None:
        seed = ensure_seed(svc.journal, svc.state_dir)
        svc.journal.set_alias("serving", seed.id)
        svc.journal.set_alias("last_good", seed.id)


def launch_managed(svc: RolloutService) -> CheckpointRef | None:
    serving = svc.journal.alias("serving")
    managed = [h for h in svc.fleet if h.managed is not None]
    for h in managed:
        assert h.managed is not None
        if h.managed.adopt():
            continue
        model = serving.local_path if serving and serving.local_path else h.spec.model
        if not model:
            log.error("managed_worker_without_model", worker=h.name)
            continue
        h.managed.launch(model, serving.version if serving else None)
    for h in managed:
        if svc.driver.wait_answering(h, svc.settings.restart_timeout_s) is None:
            log.error("managed_worker_not_ready", worker=h.name, log_file=str(h.managed.log_file if h.managed else ""))
    return serving


def recover_unfinished(svc: RolloutService, rollout: RolloutRef) -> None:
    fb_version = rollout.detail.get("fallback")
    fallback = svc.journal.checkpoint_by_version(fb_version) if fb_version else None
    serving = svc.journal.alias("serving")
    rec = Recovery(svc.journal, svc.engine, svc.driver).run(rollout, fallback)
    detail = {"recovered": True, "recovered_to": rec.version, "unrecovered": rec.unrecovered}
    ckpt = rollout.checkpoint
    if rec.finished and not rec.unrecovered:
        svc.journal.finish_rollout(rollout.id, "succeeded", detail)
        result = RolloutResult(rollout.id, "succeeded")
        svc.conclude(ckpt, result, serving, fallback, trigger=rollout.trigger)
        if rollout.trigger != "new":
            svc.journal.set_alias("last_good", ckpt.id)
    else:
        reason = "daemon restarted after the rollout had failed; undone" if not rec.finished else "not every worker recovered"
        svc.journal.finish_rollout(rollout.id, "failed", {**detail, "reason": reason})
        if rollout.trigger == "new":
            svc.journal.set_status(ckpt.id, "rejected", f"rollout {rollout.id}: {reason}")
