"""Operator commands, run on the rollout runner's thread: rollback, pin, unpin, and reconcile.

`hotswap rollback [--to V]` / `pin V` / `unpin` reach these through the daemon's HTTP API
(daemon.rollout.api_routes); a refused command raises `CommandError` with the HTTP status.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.adapters.base import WorkerError
from daemon.logging import get_logger
from daemon.rollout.journal import CheckpointRef
from daemon.rollout.states import WorkerState

if TYPE_CHECKING:
    from daemon.rollout.service import RolloutService

log = get_logger(__name__)

# A version an operator may put back: its checks passed once, whatever happened since.
DEPLOYABLE_STATUSES = ("verified", "staged", "deployed", "retired", "rejected", "superseded")


class CommandError(ValueError):
    """An operator command that cannot be done; `status` is the HTTP status the API answers with."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


def deployable(svc: RolloutService, version: str) -> CheckpointRef:
    ckpt = svc.journal.checkpoint_by_version(version)
    if ckpt is None:
        raise CommandError(f"unknown version {version!r} (see `hotswap history`)", 404)
    if not ckpt.verified or ckpt.status not in DEPLOYABLE_STATUSES:
        raise CommandError(f"version {version!r} is {ckpt.status}: only verified versions can be deployed")
    if not ckpt.local_path or not Path(ckpt.local_path).is_dir():
        raise CommandError(f"version {version!r} has no local copy (was {ckpt.local_path!r})")
    return ckpt


def rollback(svc: RolloutService, to: str | None) -> dict[str, Any]:
    serving = svc.journal.alias("serving")
    if to is not None:
        target = deployable(svc, to)
    else:
        last_good = svc.journal.alias("last_good")
        if last_good is not None and serving is not None and last_good.id != serving.id:
            candidate = last_good
        else:
            candidate = svc.journal.previous_deployed(serving.id if serving else -1)
        if candidate is None:
            raise CommandError("nothing to roll back to: no earlier version was ever deployed")
        target = deployable(svc, candidate.version)
    if svc.pinned is not None and svc.pinned != target.version:
        raise CommandError(f"pinned to {svc.pinned}: run `hotswap unpin` first")
    result = svc.engine.deploy(
        target, trigger="rollback", fallback=target,
        detail={"by": "operator", "from": serving.version if serving else None},
    )  # fmt: skip
    if result.outcome == "succeeded":
        if serving is not None and serving.id != target.id:
            svc.journal.checkpoint_event(
                serving.id, "rolled_back", {"to": target.version, "by": "operator"}, result.rollout_id
            )
            svc.journal.set_status(serving.id, "retired", f"rolled back by operator to {target.version}")
        svc.mark_serving(target, None, f"restored by operator rollback (rollout {result.rollout_id})")
        svc.journal.set_alias("last_good", target.id)
    return {"rollout_id": result.rollout_id, "version": target.version, "outcome": result.outcome,
            "reason": result.reason, "from": serving.version if serving else None}  # fmt: skip


def pin(svc: RolloutService, version: str) -> dict[str, Any]:
    target = deployable(svc, version)
    serving = svc.journal.alias("serving")
    svc.journal.set_alias("pinned", target.id)
    svc.pinned = target.version
    out: dict[str, Any] = {"pinned": target.version, "outcome": "pinned", "rollout_id": None}
    fallback = svc.fallback()
    result = svc.engine.deploy(
        target, trigger="manual", fallback=fallback if fallback and fallback.id != target.id else serving,
        detail={"by": "operator", "pin": True},
    )  # fmt: skip
    out.update(rollout_id=result.rollout_id, outcome=result.outcome, reason=result.reason)
    if result.outcome == "succeeded":
        svc.mark_serving(target, serving, f"pinned by operator (rollout {result.rollout_id})")
        svc.journal.set_alias("last_good", target.id)
    else:
        svc.journal.set_alias("pinned", None)
        svc.pinned = None
        out["pinned"] = None
    return out


def unpin(svc: RolloutService) -> dict[str, Any]:
    was = svc.pinned
    svc.journal.set_alias("pinned", None)
    svc.pinned = None
    pending = svc.queue.pending
    svc.queue.wake()
    return {"unpinned": was, "outcome": "unpinned", "next": pending.version if pending else None}


def reconcile(svc: RolloutService) -> dict[str, Any]:
    """Bring workers that run something other than the serving version back to it."""
    serving = svc.journal.alias("serving")
    if serving is None:
        return {"outcome": "nothing to reconcile"}
    target = svc.engine.fallback_target(serving)
    drifted = []
    for h in svc.fleet:
        try:
            info = h.client.weight_info()
        except WorkerError:
            continue
        if info.state == WorkerState.RUNNING and target is not None and not target.matches(info):
            drifted.append(h.name)
    if not drifted:
        return {"outcome": "in sync"}
    log.warning("reconciling", workers=drifted, version=serving.version)
    result = svc.engine.deploy(
        serving, trigger="rollback", fallback=serving, only=drifted, detail={"by": "reconcile"}
    )
    return {"rollout_id": result.rollout_id, "outcome": result.outcome, "workers": drifted}
